// A host WorkerStore's sleep and wake: offloaded bytes come back exactly at the same
// addresses, the kernel (mincore) sees the memory released and back, discarded memory
// comes back as zeros, and a sleeping store refuses loads and read-backs. The offload
// file's own errors name the directory.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "core/offload_file.h"
#include "model/worker_store.h"

namespace wsync {
namespace {

using Residency = WorkerStore::Residency;

// A store of qwen3-tiny rank 0 of 2 with its own non-zero bytes in every parameter.
std::unique_ptr<WorkerStore> FilledStore() {
  const ModelConfig c = *LookupModel("qwen3-tiny");
  auto store = *WorkerStore::Create(c, 0, 2);
  uint64_t x = 1;
  for (size_t i = 0; i < store->params().size(); ++i) {
    std::span<std::byte> bytes = store->mutable_param_bytes(i);
    for (std::byte& b : bytes) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      b = static_cast<std::byte>((x >> 56) | 1);  // never zero
    }
  }
  return store;
}

std::vector<std::vector<std::byte>> Snapshot(const WorkerStore& s) {
  std::vector<std::vector<std::byte>> out;
  for (size_t i = 0; i < s.params().size(); ++i) {
    const std::byte* p = s.param_data(i);
    out.emplace_back(p, p + s.params()[i].meta.nbytes());
  }
  return out;
}

std::vector<std::byte*> Addresses(const WorkerStore& s) {
  std::vector<std::byte*> out;
  for (size_t i = 0; i < s.params().size(); ++i) out.push_back(s.param_data(i));
  return out;
}

class WorkerStoreSleep : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) / ("wsync_offload_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // Files left in the offload directory (the offload file is unlinked: none).
  size_t FilesInDir() const {
    return std::distance(std::filesystem::directory_iterator(dir_), std::filesystem::directory_iterator());
  }
  std::filesystem::path dir_;
};

TEST_F(WorkerStoreSleep, OffloadReleasesTheMemoryAndRestoreBringsTheBytesBackInPlace) {
  auto store = FilledStore();
  const auto before = Snapshot(*store);
  const auto addresses = Addresses(*store);
  const size_t total = store->param_bytes();
  ASSERT_GT(total, size_t{1} << 20);
  EXPECT_EQ(store->resident_bytes(), total);
  EXPECT_EQ(store->offloaded_bytes(), 0u);

  ASSERT_TRUE(store->Offload(dir_.string(), 2).ok());
  EXPECT_EQ(store->residency(), Residency::kOffloaded);
  EXPECT_EQ(store->offloaded_bytes(), total);
  EXPECT_LT(store->resident_bytes(), total / 20) << "the kernel still backs the released parameters";
  EXPECT_EQ(FilesInDir(), 0u);
  // A sleeping store takes no loads and gives no read-back.
  const TensorMeta& hf = store->hf_tensors().back();
  std::vector<std::byte> bytes(hf.nbytes());
  Status load = store->Load(TensorRef{hf.name, hf.dtype, hf.shape, bytes, Device{}});
  EXPECT_EQ(load.code(), StatusCode::kFailedPrecondition) << load.ToString();
  EXPECT_NE(load.message().find("offloaded"), std::string::npos) << load.ToString();
  EXPECT_EQ(store->CopyToHost().status().code(), StatusCode::kFailedPrecondition);
  // Offloading again changes nothing.
  ASSERT_TRUE(store->Offload(dir_.string(), 2).ok());
  EXPECT_EQ(store->residency(), Residency::kOffloaded);

  ASSERT_TRUE(store->Restore(2).ok());
  EXPECT_EQ(store->residency(), Residency::kResident);
  EXPECT_EQ(store->offloaded_bytes(), 0u);
  EXPECT_EQ(store->resident_bytes(), total);
  EXPECT_EQ(Addresses(*store), addresses);
  EXPECT_TRUE(Snapshot(*store) == before);
  EXPECT_TRUE(store->Load(TensorRef{hf.name, hf.dtype, hf.shape, bytes, Device{}}).ok());
}

TEST_F(WorkerStoreSleep, DiscardedParametersWakeAsZerosInPlace) {
  auto store = FilledStore();
  const auto addresses = Addresses(*store);
  ASSERT_TRUE(store->Offload(dir_.string(), 1).ok());
  ASSERT_TRUE(store->Discard().ok());  // level 2 after level 1 drops the offloaded copy
  EXPECT_EQ(store->residency(), Residency::kDiscarded);
  EXPECT_EQ(store->offloaded_bytes(), 0u);
  EXPECT_LT(store->resident_bytes(), store->param_bytes() / 20);
  ASSERT_TRUE(store->Restore(2).ok());
  EXPECT_EQ(store->resident_bytes(), store->param_bytes());
  EXPECT_EQ(Addresses(*store), addresses);
  for (const auto& param : Snapshot(*store)) {
    EXPECT_TRUE(std::all_of(param.begin(), param.end(), [](std::byte b) { return b == std::byte{0}; }));
  }
}

TEST_F(WorkerStoreSleep, AnOffloadThatCannotStartReleasesNothing) {
  auto store = FilledStore();
  const auto before = Snapshot(*store);
  const std::string missing = (dir_ / "no" / "such").string();
  Status s = store->Offload(missing, 2);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find(missing), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("tp rank 0"), std::string::npos) << s.ToString();
  EXPECT_EQ(store->residency(), Residency::kResident);
  EXPECT_EQ(store->resident_bytes(), store->param_bytes());
  EXPECT_TRUE(Snapshot(*store) == before);
}

TEST_F(WorkerStoreSleep, AnOffloadFileLargerThanTheFreeSpaceIsRefusedNamingTheDirectory) {
  Result<uint64_t> free = FreeBytes(dir_.string());
  ASSERT_TRUE(free.ok()) << free.status().ToString();
  auto file = OffloadFile::Create(dir_.string(), *free + (uint64_t{1} << 40));
  ASSERT_EQ(file.status().code(), StatusCode::kFailedPrecondition) << file.status().ToString();
  EXPECT_NE(file.status().message().find(dir_.string()), std::string::npos);
  EXPECT_NE(file.status().message().find("--offload-dir"), std::string::npos);
  EXPECT_EQ(FilesInDir(), 0u);
  // A file that fits round-trips and leaves nothing behind.
  auto small = OffloadFile::Create(dir_.string(), 4096);
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  std::vector<std::byte> out(4096, std::byte{7}), in(4096);
  ASSERT_TRUE((*small)->Write(0, out).ok());
  ASSERT_TRUE((*small)->Read(0, in).ok());
  EXPECT_EQ(in, out);
  EXPECT_EQ((*small)->Write(4000, out).code(), StatusCode::kInternal);  // past the end
  EXPECT_EQ(FilesInDir(), 0u);
}

}  // namespace
}  // namespace wsync
