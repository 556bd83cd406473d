#include "model/worker_store.h"

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include <gtest/gtest.h>

#include <fmt/format.h>

#include "core/prefault.h"
#include "testing/host_backed_device.h"
#include "wsync/device_runtime.h"

namespace wsync {
namespace {

ModelConfig Model(const std::string& name) { return *LookupModel(name); }

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Every HF tensor of the model, each filled with its own deterministic bytes.
std::vector<HostTensor> FilledHf(const ModelConfig& c, uint64_t seed = 1) {
  std::vector<HostTensor> out;
  uint64_t t = 0;
  for (TensorMeta m : HfTensors(c)) {
    HostTensor h = *HostTensor::Zeros(std::move(m));
    std::byte* p = h.storage.data();
    for (size_t i = 0; i < h.meta.nbytes(); i += 8) {
      uint64_t v = SplitMix(seed * 0x1000003 + (t << 36) + i);
      std::memcpy(p + i, &v, std::min<size_t>(8, h.meta.nbytes() - i));
    }
    out.push_back(std::move(h));
    ++t;
  }
  return out;
}

struct Group {
  std::vector<std::unique_ptr<WorkerStore>> stores;
  std::vector<const WorkerStore*> view;
};

Group MakeGroup(const ModelConfig& c, int tp, Drafter drafter = Drafter::kNone) {
  Group g;
  for (int r = 0; r < tp; ++r) {
    auto s = WorkerStore::Create(c, r, tp, {}, drafter);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    g.view.push_back(s->get());
    g.stores.push_back(std::move(s).value());
  }
  return g;
}

// A host group and a group on `device` (the host-backed stand-in for a GPU) of TP `tp`,
// both loaded with `hf`.
struct HostAndDevice {
  Group host;
  Group device;
};
HostAndDevice LoadHostAndDevice(const ModelConfig& c, int tp, const std::vector<HostTensor>& hf, const Device& device) {
  HostAndDevice g{MakeGroup(c, tp), {}};
  for (int r = 0; r < tp; ++r) {
    auto s = WorkerStore::Create(c, r, tp, device);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    g.device.view.push_back(s->get());
    g.device.stores.push_back(std::move(s).value());
  }
  for (const HostTensor& t : hf) {
    for (auto& st : g.host.stores) EXPECT_TRUE(st->Load(t.ref()).ok()) << t.meta.name;
    for (auto& st : g.device.stores) EXPECT_TRUE(st->Load(t.ref()).ok()) << t.meta.name;
  }
  return g;
}

TEST(WorkerStore, LoadThenReadBackIsIdentity) {
  for (const char* name : {"qwen3-tiny", "qwen3-moe-tiny"}) {
    const ModelConfig c = Model(name);
    const std::vector<HostTensor> hf = FilledHf(c);
    for (int tp : {1, 2, 4}) {
      SCOPED_TRACE(std::string(name) + " tp=" + std::to_string(tp));
      Group g = MakeGroup(c, tp);
      std::vector<const std::byte*> addresses;
      for (const auto& s : g.stores) {
        for (const HostTensor& p : s->params()) addresses.push_back(p.storage.data());
      }
      for (const HostTensor& t : hf) {
        for (auto& s : g.stores) ASSERT_TRUE(s->Load(t.ref()).ok()) << t.meta.name;
      }
      size_t n = 0;
      for (const auto& s : g.stores) {
        for (const HostTensor& p : s->params()) EXPECT_EQ(p.storage.data(), addresses[n++]);
      }
      std::vector<std::byte> back;
      for (const HostTensor& t : hf) {
        back.assign(t.meta.nbytes(), std::byte{0x5a});
        ASSERT_TRUE(ReadBackHf(g.view, t.meta.name, back).ok());
        ASSERT_EQ(std::memcmp(back.data(), t.storage.data(), back.size()), 0) << t.meta.name;
      }
      EXPECT_TRUE(CheckReplicas(g.view).ok());
      auto digests = AllHfDigests(g.view, DigestAlgorithm::kXxh3_128, 2);
      ASSERT_TRUE(digests.ok()) << digests.status().ToString();
      ASSERT_EQ(digests->size(), hf.size());
      for (const HostTensor& t : hf) {
        const std::string want = HexDigest(DigestAlgorithm::kXxh3_128, t.ref().bytes);
        EXPECT_EQ(digests->at(t.meta.name), want) << t.meta.name;
        // The bounded-block path, one row at a time, agrees.
        EXPECT_EQ(*HfDigest(g.view, t.meta.name, DigestAlgorithm::kXxh3_128, 1), want);
      }
    }
  }
}

// Landing digests: a store hashes what it lands of every tensor it holds whole (all of
// them at TP=1, the replicated ones at TP>1), by Load and by LoadEach alike; the digest is
// of the bytes in the parameters (a corrupted landing shows), a LoadPiece into a
// parameter forgets its tensors' digests, and BeginLandingDigests(false) hashes nothing.
TEST(WorkerStore, LandingDigestsAreOfTheLandedBytes) {
  for (const char* name : {"qwen3-tiny", "qwen3-moe-tiny"}) {
    const ModelConfig c = Model(name);
    const std::vector<HostTensor> hf = FilledHf(c, 7);
    std::vector<TensorRef> refs;
    for (const HostTensor& t : hf) refs.push_back(t.ref());
    for (int tp : {1, 2}) {
      for (bool each : {false, true}) {
        SCOPED_TRACE(fmt::format("{} tp={} {}", name, tp, each ? "LoadEach" : "Load"));
        Group g = MakeGroup(c, tp);
        for (auto& s : g.stores) {
          s->BeginLandingDigests(true);
          ASSERT_TRUE(s->HashesLandings());
          if (each) {
            ASSERT_TRUE(s->LoadEach(refs, 3).ok());
          } else {
            for (const TensorRef& r : refs) ASSERT_TRUE(s->Load(r).ok()) << r.name;
          }
        }
        size_t whole = 0;
        for (const HostTensor& t : hf) {
          std::optional<std::string> got = g.stores[0]->LandedDigest(t.meta.name);
          if (tp == 1) {
            ASSERT_TRUE(got.has_value()) << t.meta.name;
          }
          if (!got) continue;
          ++whole;
          EXPECT_EQ(*got, HexDigest(DigestAlgorithm::kXxh3_128, t.ref().bytes)) << t.meta.name;
          EXPECT_EQ(*got, *HfDigest(g.view, t.meta.name, DigestAlgorithm::kXxh3_128)) << t.meta.name;
        }
        if (tp > 1) {
          EXPECT_GT(whole, 0u);  // the norms
          EXPECT_LT(whole, hf.size());
        }
      }
    }
  }
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<HostTensor> hf = FilledHf(c, 9);
  Group g = MakeGroup(c, 1);
  WorkerStore& s = *g.stores[0];
  s.set_fault_corrupt_landing("model.embed_tokens.weight");
  s.BeginLandingDigests(true);
  for (const HostTensor& t : hf) ASSERT_TRUE(s.Load(t.ref()).ok());
  for (const HostTensor& t : hf) {
    const std::string sent = HexDigest(DigestAlgorithm::kXxh3_128, t.ref().bytes);
    const std::string held = *HfDigest(g.view, t.meta.name, DigestAlgorithm::kXxh3_128);
    EXPECT_EQ(*s.LandedDigest(t.meta.name), held) << t.meta.name;
    EXPECT_EQ(held == sent, t.meta.name != "model.embed_tokens.weight") << t.meta.name;
  }
  // A slice landed into a parameter: the digests of its tensors are forgotten.
  const int param = s.table().FindParam("model.layers.0.self_attn.qkv_proj.weight");
  ASSERT_GE(param, 0);
  const PieceRuns r = s.table().Runs(param, 0);
  std::vector<std::byte> slice(static_cast<size_t>(r.count * r.run_bytes));
  ASSERT_TRUE(s.LoadPiece(param, 0, slice, Device{}).ok());
  for (const ShardPiece& p : s.table().params()[param].pieces) EXPECT_FALSE(s.LandedDigest(p.hf_name)) << p.hf_name;
  EXPECT_TRUE(s.LandedDigest("model.norm.weight").has_value());
  s.BeginLandingDigests(false);
  EXPECT_FALSE(s.HashesLandings());
  ASSERT_TRUE(s.Load(hf.back().ref()).ok());
  EXPECT_FALSE(s.LandedDigest(hf.back().meta.name).has_value());
}

// An MTP model's stream lands whole either way; only a drafter server holds (and reads
// back) the MTP layer, and its embed_tokens / head are the target's memory.
TEST(WorkerStore, MtpDrafterHoldsItsLayersAndSharesEmbedAndHead) {
  const ModelConfig c = Model("glm4-moe-tiny");  // layers 0-2, MTP layer 3
  const std::vector<HostTensor> hf = FilledHf(c);
  for (int tp : {1, 2}) {
    SCOPED_TRACE("tp=" + std::to_string(tp));
    Group plain = MakeGroup(c, tp), mtp = MakeGroup(c, tp, Drafter::kMtp);
    for (Group* g : {&plain, &mtp}) {
      for (auto& s : g->stores) s->BeginDrafterUpdate();
      for (const HostTensor& t : hf) {
        for (auto& s : g->stores) ASSERT_TRUE(s->Load(t.ref()).ok()) << t.meta.name;
      }
    }
    for (auto& s : plain.stores) EXPECT_FALSE(*s->FinishDrafterUpdate());
    for (auto& s : mtp.stores) EXPECT_TRUE(*s->FinishDrafterUpdate());
    auto plain_sums = AllHfDigests(plain.view, DigestAlgorithm::kXxh3_128, 2);
    auto mtp_sums = AllHfDigests(mtp.view, DigestAlgorithm::kXxh3_128, 2);
    ASSERT_TRUE(plain_sums.ok() && mtp_sums.ok());
    size_t mtp_tensors = 0;
    for (const HostTensor& t : hf) {
      const std::string want = HexDigest(DigestAlgorithm::kXxh3_128, t.ref().bytes);
      EXPECT_EQ(mtp_sums->at(t.meta.name), want) << t.meta.name;
      if (MtpLayerOf(c, t.meta.name) >= 0) {
        ++mtp_tensors;
        EXPECT_FALSE(plain_sums->contains(t.meta.name)) << t.meta.name;
      } else {
        EXPECT_EQ(plain_sums->at(t.meta.name), want) << t.meta.name;
      }
    }
    EXPECT_GT(mtp_tensors, 10u);
    EXPECT_EQ(plain_sums->size() + mtp_tensors, hf.size());
    // The aliases read the target's parameters' own addresses: no second copy.
    const WorkerStore& s = *mtp.stores[0];
    size_t own = 0, aliases = 0;
    for (const WorkerStore::DrafterParam& p : s.drafter_params()) {
      if (p.shares < 0) {
        own += p.bytes;
        continue;
      }
      ++aliases;
      EXPECT_EQ(p.data, s.param_data(p.shares)) << p.name;
      EXPECT_TRUE(p.name == "model.layers.3.embed_tokens.weight" || p.name == "model.layers.3.shared_head.head.weight")
          << p.name;
    }
    EXPECT_EQ(aliases, 2u);
    EXPECT_EQ(s.param_bytes(), plain.stores[0]->param_bytes() + own);
  }
}

// A drafter layer touched but not completed by an update is named; one never touched
// leaves the drafter as it was (FinishDrafterUpdate answers false).
TEST(WorkerStore, DrafterLayerMustLandWhole) {
  const ModelConfig c = Model("deepseek-v3-tiny");
  const std::vector<HostTensor> hf = FilledHf(c);
  auto s = *WorkerStore::Create(c, 0, 2, {}, Drafter::kMtp);
  s->BeginDrafterUpdate();
  for (const HostTensor& t : hf) {
    if (t.meta.name == "model.layers.3.mlp.experts.5.up_proj.weight") continue;
    ASSERT_TRUE(s->Load(t.ref()).ok());
  }
  Result<bool> partial = s->FinishDrafterUpdate();
  EXPECT_EQ(partial.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(partial.status().message().find("model.layers.3: 1 of "), std::string::npos) << partial.status().message();
  EXPECT_NE(partial.status().message().find("mlp.experts.5.up_proj.weight"), std::string::npos);
  EXPECT_NE(partial.status().message().find("the MTP drafter was not reloaded whole"), std::string::npos);
  // The next update starts afresh: only target tensors touch no drafter layer.
  s->BeginDrafterUpdate();
  for (const HostTensor& t : hf) {
    if (MtpLayerOf(c, t.meta.name) < 0) {
      ASSERT_TRUE(s->Load(t.ref()).ok());
    }
  }
  EXPECT_FALSE(*s->FinishDrafterUpdate());
  // Planned copies (the ipc backend's batched landing, replayed from an earlier update)
  // land when the backend says they ran, not when they are planned.
  s->BeginDrafterUpdate();
  std::vector<WorkerSink::ByteCopy> copies;
  std::vector<TensorMeta> metas;
  for (const HostTensor& t : hf) {
    ASSERT_TRUE(s->PlanLoad(t.ref(), &copies).ok());
    metas.push_back(t.meta);
  }
  EXPECT_FALSE(*s->FinishDrafterUpdate());
  for (int update = 0; update < 2; ++update) {
    s->BeginDrafterUpdate();
    s->PlannedCopiesRan(metas);
    EXPECT_TRUE(*s->FinishDrafterUpdate());
  }
}

TEST(WorkerStore, ShardBytesLandWhereTheTableSays) {
  // qwen3-tiny TP 2 rank 1: the q part of qkv_proj is q_proj rows [128, 256).
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<HostTensor> hf = FilledHf(c);
  auto s = *WorkerStore::Create(c, 1, 2);
  for (const HostTensor& t : hf) ASSERT_TRUE(s->Load(t.ref()).ok());
  const HostTensor& q = hf[1];
  ASSERT_EQ(q.meta.name, "model.layers.0.self_attn.q_proj.weight");
  const HostTensor& qkv = s->params()[s->table().FindParam("model.layers.0.self_attn.qkv_proj.weight")];
  const size_t row = 256 * 2;
  EXPECT_EQ(std::memcmp(qkv.storage.data(), q.storage.data() + 128 * row, 128 * row), 0);
  // o_proj row 5 of rank 1 is HF o_proj row 5, columns [128, 256).
  const HostTensor& o = hf[4];
  const HostTensor& po = s->params()[s->table().FindParam("model.layers.0.self_attn.o_proj.weight")];
  EXPECT_EQ(std::memcmp(po.storage.data() + 5 * 128 * 2, o.storage.data() + 5 * row + 128 * 2, 128 * 2), 0);
}

TEST(WorkerStore, VocabPaddingStaysZero) {
  ModelConfig c = Model("qwen3-tiny");
  c.name = "odd-vocab";
  c.vocab_size = 4000;
  const std::vector<HostTensor> hf = FilledHf(c);
  Group g = MakeGroup(c, 4);
  for (const HostTensor& t : hf) {
    for (auto& s : g.stores) ASSERT_TRUE(s->Load(t.ref()).ok());
  }
  const HostTensor& embed = g.stores[3]->params()[0];
  const size_t row = 256 * 2;
  // Rank 3 holds HF rows [3024, 4000) in rows [0, 976); rows [976, 1008) are padding.
  EXPECT_EQ(std::memcmp(embed.storage.data(), hf[0].storage.data() + 3024 * row, 976 * row), 0);
  std::vector<std::byte> zeros(32 * row);
  EXPECT_EQ(std::memcmp(embed.storage.data() + 976 * row, zeros.data(), zeros.size()), 0);
  std::vector<std::byte> back(hf[0].meta.nbytes());
  ASSERT_TRUE(ReadBackHf(g.view, "model.embed_tokens.weight", back).ok());
  EXPECT_EQ(std::memcmp(back.data(), hf[0].storage.data(), back.size()), 0);
}

TEST(WorkerStore, CheckHfMessages) {
  auto s = *WorkerStore::Create(Model("qwen3-0.6b"), 0, 1);
  Status missing = s->CheckHf({"lm_head.weight", DType::kBF16, {151936, 1024}});
  EXPECT_EQ(missing.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(missing.message(), "model qwen3-0.6b has no tensor lm_head.weight");
  Status shape = s->CheckHf({"model.layers.3.mlp.up_proj.weight", DType::kBF16, {1024, 3072}});
  EXPECT_EQ(shape.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(shape.message(),
            "shape of model.layers.3.mlp.up_proj.weight is [3072, 1024], update says [1024, 3072]");
  Status dtype = s->CheckHf({"model.norm.weight", DType::kF32, {1024}});
  EXPECT_EQ(dtype.message(),
            "dtype of model.norm.weight is bfloat16, update says float32: send it as bfloat16 (Python: "
            "StateDictSource(..., dtype=torch.bfloat16) casts each tensor as it is sent)");
  EXPECT_TRUE(s->CheckHf({"model.norm.weight", DType::kBF16, {1024}}).ok());
}

TEST(WorkerStore, LoadRejectsBadInputAndWritesNothing) {
  auto s = *WorkerStore::Create(Model("qwen3-tiny"), 0, 1);
  std::vector<std::byte> bytes(256 * 2 - 2, std::byte{1});
  Shape shape{256};
  TensorRef short_ref{"model.norm.weight", DType::kBF16, shape, bytes, Device{}};
  Status st = s->Load(short_ref);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "tensor model.norm.weight of shape [256] needs 512 bytes, update has 510");
  const HostTensor& norm = s->params()[s->table().FindParam("model.norm.weight")];
  for (size_t i = 0; i < norm.meta.nbytes(); ++i) ASSERT_EQ(norm.storage.data()[i], std::byte{0});
  TensorRef gpu{"model.norm.weight", DType::kBF16, shape, bytes, Device{Device::Kind::kCuda, 0}};
  EXPECT_EQ(s->Load(gpu).message(),
            "tensor model.norm.weight is on cuda:0; this store is on cpu and loads host tensors");
  // Without a CUDA runtime installed (this test binary has none), a CUDA store is refused.
  auto on_gpu = WorkerStore::Create(Model("qwen3-tiny"), 0, 1, Device{Device::Kind::kCuda, 0});
  EXPECT_EQ(on_gpu.status().code(), StatusCode::kUnimplemented) << on_gpu.status().ToString();
  TensorRef unknown{"model.layers.9.mlp.up_proj.weight", DType::kBF16, shape, bytes, Device{}};
  EXPECT_EQ(s->Load(unknown).message(), "model qwen3-tiny has no tensor model.layers.9.mlp.up_proj.weight");
}

TEST(WorkerStore, CheckReplicasNamesTheDivergentCopy) {
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<HostTensor> hf = FilledHf(c);
  Group g = MakeGroup(c, 4);
  for (const HostTensor& t : hf) {
    for (auto& s : g.stores) ASSERT_TRUE(s->Load(t.ref()).ok());
  }
  ASSERT_TRUE(CheckReplicas(g.view).ok());

  // Rank 3 holds KV head 1 as a replica of rank 2's; flip one byte of its k rows.
  WorkerStore& r3 = *g.stores[3];
  const int qkv = r3.table().FindParam("model.layers.1.self_attn.qkv_proj.weight");
  r3.mutable_param_bytes(qkv)[64 * 256 * 2 + 7] ^= std::byte{1};
  Status st = CheckReplicas(g.view);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_EQ(st.message(),
            "replica of model.layers.1.self_attn.k_proj.weight [64, 128) along dim 0 on tp rank 3 "
            "differs from the primary copy on tp rank 2");
  // Read-back uses the primary, so the HF digest is unchanged.
  EXPECT_EQ(*HfDigest(g.view, "model.layers.1.self_attn.k_proj.weight", DigestAlgorithm::kSha256),
            HexDigest(DigestAlgorithm::kSha256, hf[2 + 11].ref().bytes));
  r3.mutable_param_bytes(qkv)[64 * 256 * 2 + 7] ^= std::byte{1};

  WorkerStore& r1 = *g.stores[1];
  r1.mutable_param_bytes(r1.table().FindParam("model.norm.weight"))[0] ^= std::byte{1};
  EXPECT_EQ(CheckReplicas(g.view).message(),
            "replica of model.norm.weight (whole tensor) on tp rank 1 differs from the primary "
            "copy on tp rank 0");
}

TEST(WorkerStore, CudaStoresAreDigestedInBoundedBlocksWithoutAWholeCopy) {
  HostBackedDevice device;
  const Device gpu{Device::Kind::kCuda, 0};
  for (const std::string model : {"qwen3-tiny", "qwen3-moe-tiny"}) {
    const ModelConfig c = Model(model);
    const std::vector<HostTensor> hf = FilledHf(c, 3);
    for (int tp : {1, 2, 4}) {
      if (model == "qwen3-moe-tiny" && tp == 4) continue;
      SCOPED_TRACE(fmt::format("{} tp {}", model, tp));
      Group host = MakeGroup(c, tp);
      Group cuda;
      for (int r = 0; r < tp; ++r) {
        auto st = WorkerStore::Create(c, r, tp, gpu);
        ASSERT_TRUE(st.ok()) << st.status().ToString();
        cuda.view.push_back(st->get());
        cuda.stores.push_back(std::move(st).value());
      }
      for (const HostTensor& t : hf) {
        for (auto& st : host.stores) ASSERT_TRUE(st->Load(t.ref()).ok());
        for (auto& st : cuda.stores) ASSERT_TRUE(st->Load(t.ref()).ok());
      }
      EXPECT_FALSE(CheckTpGroup(cuda.view).ok());  // ReadBackHf still takes host stores only
      ASSERT_TRUE(CheckReplicas(cuda.view).ok());
      device.largest_ = 0;
      auto want = AllHfDigests(host.view, DigestAlgorithm::kXxh3_128, 2);
      auto got = AllHfDigests(cuda.view, DigestAlgorithm::kXxh3_128, 2);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_EQ(*got, *want);
      // Each copy moves at most one block of rows, never a whole store.
      EXPECT_LE(device.largest_.load(), kDeviceReadBackBlockBytes);
      // One row per block: many small blocks give the same digest.
      const std::string name = "model.layers.0.self_attn.o_proj.weight";
      EXPECT_EQ(*HfDigest(cuda.view, name, DigestAlgorithm::kSha256, 1),
                *HfDigest(host.view, name, DigestAlgorithm::kSha256));
    }
  }
}

// The finish's device digests (DeviceHeldDigests): what a device store holds in one run is
// digested through DeviceRuntime::Xxh3Digests (here the host-backed stand-in, which runs
// the kernel's schedule) and equals the read-back digests, whole and by row ranges; a
// tensor a TP rank holds only part of is left to the read-back.
TEST(WorkerStore, DeviceHeldDigestsEqualTheReadBackOnes) {
  HostBackedDevice device;
  const Device gpu{Device::Kind::kCuda, 0};
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<HostTensor> hf = FilledHf(c, 5);
  for (int tp : {1, 2}) {
    SCOPED_TRACE(fmt::format("tp {}", tp));
    const HostAndDevice g = LoadHostAndDevice(c, tp, hf, gpu);
    const Group& host = g.host;
    const std::vector<const WorkerStore*>& group = g.device.view;
    std::vector<TensorMeta> metas;
    for (const HostTensor& t : hf) metas.push_back(t.meta);
    const std::string embed = "model.embed_tokens.weight";
    const int64_t rows = std::ranges::find(metas, embed, &TensorMeta::name)->shape[0];
    const std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> ranges{
        {embed, {{0, 3}, {3, rows / 2}, {rows / 2, rows}}}};
    const int launches = device.digest_launches();
    auto got = DeviceHeldDigests(group, metas, ranges);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(device.digest_launches(), launches + 1);  // one launch for the whole device
    std::vector<std::byte> scratch;
    size_t held = 0;
    for (const TensorMeta& m : metas) {
      auto it = got->find(m.name);
      // Split across TP=2 (q_proj's rows, o_proj's columns): absent, read back instead.
      if (it == got->end()) {
        EXPECT_EQ(tp, 2) << m.name;
        continue;
      }
      ++held;
      if (m.name == embed && tp == 1) {
        EXPECT_EQ(it->second, *HfRangesDigest(host.view, m.name, ranges.at(embed), DigestAlgorithm::kXxh3_128,
                                              &scratch));
        EXPECT_EQ(std::ranges::count(it->second, ','), 2);
      } else {
        EXPECT_EQ(it->second, *HfDigest(host.view, m.name, DigestAlgorithm::kXxh3_128)) << m.name;
      }
    }
    if (tp == 1) {
      EXPECT_EQ(held, metas.size());
    } else {
      EXPECT_GT(held, 0u);
    }
    EXPECT_TRUE(got->contains("model.norm.weight"));
  }
}

// A checksum of a device group (/weight_checker, push --verify) takes what the stores hold
// in one run on the device and reads back only the rest: the same digests as the host's.
TEST(WorkerStore, AllHfDigestsOfADeviceGroupDigestHeldRunsOnTheDevice) {
  HostBackedDevice device;
  const Device gpu{Device::Kind::kCuda, 0};
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<HostTensor> hf = FilledHf(c, 6);
  for (int tp : {1, 2}) {
    SCOPED_TRACE(fmt::format("tp {}", tp));
    const HostAndDevice g = LoadHostAndDevice(c, tp, hf, gpu);
    const Group& host = g.host;
    const std::vector<const WorkerStore*>& group = g.device.view;
    const auto want = AllHfDigests(host.view, DigestAlgorithm::kXxh3_128, 2);
    ASSERT_TRUE(want.ok()) << want.status().ToString();
    int launches = device.digest_launches();
    auto got = AllHfDigests(group, DigestAlgorithm::kXxh3_128, 2);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, *want);
    EXPECT_EQ(got->size(), hf.size());
    EXPECT_EQ(device.digest_launches(), launches + 1);
    // sha256 has no device kernel: all of it is read back.
    launches = device.digest_launches();
    auto sha = AllHfDigests(group, DigestAlgorithm::kSha256, 2);
    ASSERT_TRUE(sha.ok()) << sha.status().ToString();
    EXPECT_EQ(*sha, *AllHfDigests(host.view, DigestAlgorithm::kSha256, 2));
    EXPECT_EQ(device.digest_launches(), launches);
  }
}

TEST(WorkerStore, GroupErrors) {
  const ModelConfig c = Model("qwen3-tiny");
  Group g = MakeGroup(c, 2);
  std::vector<const WorkerStore*> swapped = {g.view[1], g.view[0]};
  std::vector<std::byte> out(512);
  Status st = ReadBackHf(swapped, "model.norm.weight", out);
  EXPECT_EQ(st.message(), "TP group entry 0 of 2 is a store of tp rank 1 of tp_size 2");
  EXPECT_EQ(ReadBackHf(g.view, "model.norm.weight", std::span(out).first(10)).message(),
            "read-back of model.norm.weight needs 512 bytes, buffer has 10");
  EXPECT_EQ(ReadBackHf(g.view, "nope", out).code(), StatusCode::kNotFound);
  std::vector<const WorkerStore*> partial = {g.view[0]};
  EXPECT_FALSE(CheckTpGroup(partial).ok());
  EXPECT_FALSE(AllHfDigests({}, DigestAlgorithm::kSha256, 2).ok());
}

// Create() leaves every byte of a host store resident, so the first sync's loads take
// no page faults: counted, for the loading thread, with getrusage.
TEST(WorkerStore, HostParametersAreResidentFromCreate) {
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<HostTensor> hf = FilledHf(c);
  auto store = WorkerStore::Create(c, 0, 1);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const long page = sysconf(_SC_PAGESIZE);
  long pages = 0;
  for (size_t i = 0; i < (*store)->params().size(); ++i) {
    const std::span<const std::byte> bytes = (*store)->params()[i].storage.span();
    const long want = static_cast<long>((bytes.size() + page - 1) / page);
    EXPECT_EQ(ResidentPages(bytes), want) << (*store)->params()[i].meta.name;
    pages += want;
  }
  ASSERT_GE(pages, 1000);  // enough pages that a lazy store would fault visibly

  rusage before{}, after{};
  ASSERT_EQ(getrusage(RUSAGE_THREAD, &before), 0);
  for (const HostTensor& t : hf) ASSERT_TRUE((*store)->Load(t.ref()).ok()) << t.meta.name;
  ASSERT_EQ(getrusage(RUSAGE_THREAD, &after), 0);
  EXPECT_LT(after.ru_minflt - before.ru_minflt, pages / 20)
      << "loading every tensor into a fresh store of " << pages << " pages";
}

}  // namespace
}  // namespace wsync
