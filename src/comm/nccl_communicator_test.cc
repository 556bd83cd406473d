// Runs on a CUDA machine; skips cleanly without a GPU. One GPU allows a group of one
// rank (NCCL refuses two ranks on one device); groups of 2+ run on multi-GPU machines.
#include "comm/nccl_communicator.h"

#include <cuda_runtime.h>

#include <vector>

#include <gtest/gtest.h>

namespace wsync {
namespace {

TEST(NcclCommunicator, GroupOfOneRunsWarmupAndBroadcast) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  auto id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  EXPECT_EQ(*DecodeNcclUniqueId(EncodeNcclUniqueId(*id)), *id);
  NcclOptions o;
  o.unique_id = *id;
  o.size = 1;
  o.connect_deadline = Deadline::InSeconds(60);
  auto comm = ConnectNccl(o);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  float warmup = 1.5f;
  ASSERT_TRUE((*comm)->AllReduceSum(std::span<float>(&warmup, 1), Deadline::InSeconds(30)).ok());
  EXPECT_EQ(warmup, 1.5f);
  int64_t v[2] = {3, -4};
  ASSERT_TRUE((*comm)->AllReduceSum(std::span<int64_t>(v, 2), Deadline::InSeconds(30)).ok());
  EXPECT_EQ(v[1], -4);
  void* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, 1 << 20), cudaSuccess);
  ASSERT_TRUE((*comm)->Broadcast(std::span(static_cast<std::byte*>(dev), 1 << 20), 0, Deadline::InSeconds(30)).ok());
  cudaFree(dev);
  (*comm)->Abort();
  EXPECT_EQ((*comm)->Broadcast({}, 0, Deadline::InSeconds(1)).code(), StatusCode::kAborted);
}

TEST(NcclCommunicator, InitWaitingForAbsentRanksTimesOut) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  NcclOptions o;
  o.unique_id = *NewNcclUniqueId();
  o.size = 2;  // rank 1 never comes
  o.connect_deadline = Deadline::InSeconds(3);
  auto t0 = std::chrono::steady_clock::now();
  auto comm = ConnectNccl(o);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kDeadlineExceeded) << comm.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
  EXPECT_NE(comm.status().message().find("waiting for every rank"), std::string::npos);
}

}  // namespace
}  // namespace wsync
