// Runs on a CUDA machine; skips cleanly without a GPU. One GPU allows a group of one
// rank (NCCL refuses two ranks on one device); groups of 2+ run on multi-GPU machines.
#include "comm/nccl_communicator.h"

#include <cuda_runtime.h>

#include <functional>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <gtest/gtest.h>

namespace wsync {
namespace {

// Runs `body` on the two ranks of one NCCL group, rank r on GPU r, each on its own thread
// as two processes would be; returns each rank's status.
std::vector<Status> RunTwoGpuRanks(const std::function<Status(int rank, Communicator& comm)>& body) {
  NcclUniqueIdBytes id = *NewNcclUniqueId();
  std::vector<Status> results(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      results[rank] = [&]() -> Status {
        NcclOptions o;
        o.unique_id = id;
        o.rank = rank;
        o.size = 2;
        o.device = rank;
        o.connect_deadline = Deadline::InSeconds(60);
        WSYNC_ASSIGN_OR_RETURN(auto comm, ConnectNccl(o));
        return body(rank, *comm);
      }();
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

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

// Two ranks on two GPUs, each on its own thread as two processes would be: the warm-up,
// then all-reduces whose results must be the true sums (a non-blocking communicator's
// first collective is still connecting when it returns; its result must still be waited
// for), then a broadcast checked byte for byte.
TEST(NcclCommunicator, TwoRanksOnTwoGpusSumAndBroadcastExactly) {
  if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  constexpr size_t kBytes = size_t{64} << 20;
  std::vector<Status> results = RunTwoGpuRanks([&](int rank, Communicator& comm) -> Status {
    for (int round = 0; round < 3; ++round) {
      float f = 1.5f + rank;
      WSYNC_RETURN_IF_ERROR(comm.AllReduceSum(std::span<float>(&f, 1), Deadline::InSeconds(30)));
      if (f != 4.0f) return Internal(fmt::format("round {}: float sum {} != 4", round, f));
      int64_t v[2] = {int64_t{1} << (40 + rank), -rank};
      WSYNC_RETURN_IF_ERROR(comm.AllReduceSum(std::span<int64_t>(v, 2), Deadline::InSeconds(30)));
      if (v[0] != (int64_t{1} << 40) + (int64_t{1} << 41) || v[1] != -1) {
        return Internal(fmt::format("round {}: int64 sums {} {}", round, v[0], v[1]));
      }
    }
    std::vector<unsigned char> host(kBytes);
    for (size_t i = 0; i < kBytes; ++i) host[i] = rank == 0 ? static_cast<unsigned char>(i * 131 + 7) : 0;
    void* dev = nullptr;
    if (cudaMalloc(&dev, kBytes) != cudaSuccess) return Internal("cudaMalloc");
    cudaMemcpy(dev, host.data(), kBytes, cudaMemcpyHostToDevice);
    Status b = comm.Broadcast(std::span(static_cast<std::byte*>(dev), kBytes), 0, Deadline::InSeconds(30));
    cudaMemcpy(host.data(), dev, kBytes, cudaMemcpyDeviceToHost);
    cudaFree(dev);
    WSYNC_RETURN_IF_ERROR(b);
    for (size_t i = 0; i < kBytes; ++i) {
      if (host[i] != static_cast<unsigned char>(i * 131 + 7)) return Internal(fmt::format("byte {} differs", i));
    }
    return Status::Ok();
  });
  EXPECT_TRUE(results[0].ok()) << results[0].ToString();
  EXPECT_TRUE(results[1].ok()) << results[1].ToString();
}

// Two ranks on two GPUs exchange buffers both ways in one batch (three messages each way,
// one of them empty), with two more batches posted before the first is waited on; every
// byte is checked. Then a send to self is rejected.
TEST(NcclCommunicator, TwoRanksExchangeBothWaysInOneBatchBitExact) {
  if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices (found " << CudaDeviceCount() << ")";
  // Per direction: 3 MiB + 5, 1 byte, 0 bytes.
  const std::vector<size_t> sizes = {(size_t{3} << 20) + 5, 1, 0};
  auto value = [](int src, size_t msg, size_t i) { return static_cast<unsigned char>(src * 71 + msg * 13 + i * 131 + 7); };
  std::vector<Status> results = RunTwoGpuRanks([&](int rank, Communicator& comm) -> Status {
    const int peer = 1 - rank;
    std::vector<void*> out(sizes.size(), nullptr), in(sizes.size(), nullptr);
    std::vector<Communicator::PeerMessage> sends, receives;
    for (size_t m = 0; m < sizes.size(); ++m) {
      std::vector<unsigned char> host(sizes[m]);
      for (size_t i = 0; i < sizes[m]; ++i) host[i] = value(rank, m, i);
      if (sizes[m] > 0) {
        if (cudaMalloc(&out[m], sizes[m]) != cudaSuccess || cudaMalloc(&in[m], sizes[m]) != cudaSuccess) {
          return Internal("cudaMalloc");
        }
        cudaMemcpy(out[m], host.data(), sizes[m], cudaMemcpyHostToDevice);
        cudaMemset(in[m], 0, sizes[m]);
      }
      sends.push_back({peer, static_cast<uint32_t>(m), std::span(static_cast<std::byte*>(out[m]), sizes[m])});
      receives.push_back({peer, static_cast<uint32_t>(m), std::span(static_cast<std::byte*>(in[m]), sizes[m])});
    }
    WSYNC_ASSIGN_OR_RETURN(auto first, comm.PostPeerBatch(sends, receives));
    // Two more batches in flight before the first is waited on: the large message
    // again each way. Batches run in posting order on the stream, so rank 0 sends
    // first and rank 1 receives first (both sending first would wait for each other).
    const bool send_first = rank == 0;
    WSYNC_ASSIGN_OR_RETURN(auto second, send_first ? comm.PostPeerBatch(std::span(sends).first(1), {})
                                                   : comm.PostPeerBatch({}, std::span(receives).first(1)));
    WSYNC_ASSIGN_OR_RETURN(auto third, send_first ? comm.PostPeerBatch({}, std::span(receives).first(1))
                                                  : comm.PostPeerBatch(std::span(sends).first(1), {}));
    WSYNC_RETURN_IF_ERROR(first->Wait(Deadline::InSeconds(30)));
    WSYNC_RETURN_IF_ERROR(second->Wait(Deadline::InSeconds(30)));
    WSYNC_RETURN_IF_ERROR(third->Wait(Deadline::InSeconds(30)));
    for (size_t m = 0; m < sizes.size(); ++m) {
      std::vector<unsigned char> host(sizes[m]);
      if (sizes[m] > 0) cudaMemcpy(host.data(), in[m], sizes[m], cudaMemcpyDeviceToHost);
      for (size_t i = 0; i < sizes[m]; ++i) {
        if (host[i] != value(peer, m, i)) return Internal(fmt::format("message {} byte {} differs", m, i));
      }
    }
    for (void* p : out) cudaFree(p);
    for (void* p : in) cudaFree(p);
    const Communicator::PeerMessage self{rank, 0, {}};
    if (comm.PostPeerBatch({&self, 1}, {}).status().code() != StatusCode::kInvalidArgument) {
      return Internal("a send to self was accepted");
    }
    return Status::Ok();
  });
  EXPECT_TRUE(results[0].ok()) << results[0].ToString();
  EXPECT_TRUE(results[1].ok()) << results[1].ToString();
}

// Bad peers are rejected before anything is enqueued; a group of one has no peers.
TEST(NcclCommunicator, PeerBatchRejectsBadPeers) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  NcclOptions o;
  o.unique_id = *NewNcclUniqueId();
  o.size = 1;
  o.connect_deadline = Deadline::InSeconds(60);
  auto comm = ConnectNccl(o);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  for (int bad : {0, -1, 1}) {
    const Communicator::PeerMessage m{bad, 2, {}};
    auto b = (*comm)->PostPeerBatch({}, {&m, 1});
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(b.status().message().find(fmt::format("receive from rank {} (tag 2)", bad)), std::string::npos)
        << b.status().message();
  }
  EXPECT_TRUE((*comm)->ExchangePeers({}, {}, Deadline::InSeconds(5)).ok());
  EXPECT_FALSE((*comm)->aborted());
}

}  // namespace
}  // namespace wsync
