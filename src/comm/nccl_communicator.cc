#include "comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <span>
#include <string>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace wsync {
namespace {

using Clock = std::chrono::steady_clock;

#define WSYNC_CUDA_RETURN(expr, what)                                                   \
  do {                                                                                  \
    cudaError_t wsync_cuda_err_ = (expr);                                               \
    if (wsync_cuda_err_ != cudaSuccess) {                                               \
      return Internal(fmt::format("{}: {} failed: {} ({}:{})", what, #expr,             \
                                  cudaGetErrorString(wsync_cuda_err_), __FILE__, __LINE__)); \
    }                                                                                   \
  } while (0)

Status NcclError(ncclResult_t r, const std::string& what) {
  return Unavailable(fmt::format("{}: {} ({})", what, ncclGetErrorString(r), static_cast<int>(r)));
}

// Polls until the communicator has finished enqueuing (a non-blocking communicator
// answers ncclInProgress while it still connects peers or enqueues: the first collective
// on a new group does both) and then `done()` is true; or until the communicator reports
// an error, or the deadline passes. `done()` is never trusted while the enqueue is in
// progress: the stream may look idle only because nothing is on it yet. Spins (yielding
// the core) for the first 200 ms: a chunk on NVLink takes a few ms, and the host noticing
// its end late delays the next chunk on every rank (sleeping 20 us costs ~80 us with the
// kernel's timer slack, per chunk, per rank). Longer waits (a peer that is slow to join)
// sleep between polls.
template <typename Done>
Status PollComm(ncclComm_t comm, Done done, Deadline deadline, const std::string& what) {
  auto start = Clock::now();
  for (;;) {
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &async);
    if (r != ncclSuccess) return NcclError(r, what);
    if (async != ncclSuccess && async != ncclInProgress) return NcclError(async, what);
    if (async == ncclSuccess && done()) return Status::Ok();
    if (deadline.expired()) return DeadlineExceeded(fmt::format("{}: timed out", what));
    if (Clock::now() - start > std::chrono::milliseconds(200)) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      std::this_thread::yield();
    }
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclOptions& o, ncclComm_t comm, cudaStream_t stream, void* scratch)
      : options_(o), comm_(comm), stream_(stream), scratch_(scratch) {}

  ~NcclCommunicator() override {
    cudaSetDevice(options_.device);
    if (!aborted_) {
      ncclCommFinalize(comm_);
      ncclCommDestroy(comm_);
    }
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  std::string_view kind() const override { return "nccl"; }

  Status Broadcast(std::span<std::byte> data, int root, Deadline deadline) override {
    return Broadcast(data, root, deadline, StreamHooks{});
  }

  // Every broadcast goes in pieces of options_.piece_bytes (0: one piece), with or without
  // hooks, so that every rank makes the same ncclBroadcast calls: the root enqueues piece i as soon as
  // before_send says its bytes are ready, and a receiver reports each piece once its event
  // has completed, so the caller's packing and unpacking overlap the wire. Pieces are
  // enqueued back to back without waiting for one another (stream order keeps them in
  // sequence).
  Status Broadcast(std::span<std::byte> data, int root, Deadline deadline, const StreamHooks& hooks) override {
    const bool feed = options_.rank == root && hooks.before_send;
    const bool report = options_.rank != root && hooks.on_received;
    std::string what = fmt::format("nccl broadcast of {} bytes from {} on {}", data.size(),
                                   DescribeRankOrDefault(options_.describe_rank, root),
                                   DescribeRankOrDefault(options_.describe_rank, options_.rank));
    if (aborted_) return Aborted(what + ": the communicator was aborted by an earlier failure");
    cudaSetDevice(options_.device);
    Deadline d = deadline.Min(Deadline::In(options_.op_timeout));
    const size_t n = data.size();
    const size_t piece_bytes = options_.piece_bytes > 0 ? options_.piece_bytes : std::max<size_t>(n, 1);
    const size_t pieces = std::max<size_t>(1, (n + piece_bytes - 1) / piece_bytes);
    while (events_.size() < pieces) {
      cudaEvent_t e = nullptr;
      WSYNC_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), what);
      events_.push_back(e);
    }
    auto piece_end = [&](size_t i) { return std::min(n, (i + 1) * piece_bytes); };
    size_t reported = 0;
    Status s;
    for (size_t i = 0; i < pieces && s.ok(); ++i) {
      const size_t begin = i * piece_bytes, end = piece_end(i);
      if (feed) {
        s = hooks.before_send(end);
        if (!s.ok()) break;
      }
      ncclResult_t r = ncclBroadcast(data.data() + begin, data.data() + begin, end - begin, ncclUint8, root, comm_, stream_);
      if (r != ncclSuccess && r != ncclInProgress) {
        s = NcclError(r, what);
        break;
      }
      // A non-blocking communicator must finish enqueuing before the next call.
      s = PollComm(comm_, [] { return true; }, d, what);
      if (!s.ok()) break;
      if (cudaEventRecord(events_[i], stream_) != cudaSuccess) {
        s = Internal(fmt::format("{}: cudaEventRecord: {}", what, cudaGetErrorString(cudaGetLastError())));
        break;
      }
      while (report && reported <= i && cudaEventQuery(events_[reported]) == cudaSuccess) {
        hooks.on_received(piece_end(reported++));
      }
    }
    if (s.ok()) {
      for (size_t i = reported; i < pieces && s.ok(); ++i) {
        s = PollComm(comm_, [&] { return cudaEventQuery(events_[i]) != cudaErrorNotReady; }, d, what);
        if (s.ok() && cudaEventQuery(events_[i]) != cudaSuccess) {
          s = Internal(fmt::format("{}: {}", what, cudaGetErrorString(cudaGetLastError())));
        }
        if (s.ok() && report) hooks.on_received(piece_end(i));
      }
    }
    if (!s.ok()) Abort();  // peers may be waiting for pieces this rank will never send
    return s;
  }

  Status AllReduceSum(std::span<int64_t> data, Deadline deadline) override {
    return AllReduce(data.data(), data.size() * sizeof(int64_t), data.size(), ncclInt64, deadline);
  }
  Status AllReduceSum(std::span<float> data, Deadline deadline) override {
    return AllReduce(data.data(), data.size() * sizeof(float), data.size(), ncclFloat32, deadline);
  }

  Result<std::unique_ptr<PeerBatch>> PostPeerBatch(std::span<const PeerMessage> sends,
                                                   std::span<const PeerMessage> receives) override;

  void Abort() override {
    bool expected = false;
    if (aborted_.compare_exchange_strong(expected, true)) ncclCommAbort(comm_);
  }
  bool aborted() const override { return aborted_; }

 private:
  // Enqueues `launch` on the stream and waits for it within the op timeout and deadline.
  template <typename Launch>
  Status Run(const std::string& what, Deadline deadline, Launch launch) {
    if (aborted_) return Aborted(what + ": the communicator was aborted by an earlier failure");
    cudaSetDevice(options_.device);
    Deadline d = deadline.Min(Deadline::In(options_.op_timeout));
    ncclResult_t r = launch();
    Status s = (r == ncclSuccess || r == ncclInProgress) ? Status::Ok() : NcclError(r, what);
    if (s.ok()) {
      s = PollComm(comm_, [&] { return cudaStreamQuery(stream_) != cudaErrorNotReady; }, d, what);
    }
    if (s.ok() && cudaStreamQuery(stream_) != cudaSuccess) {
      s = Internal(fmt::format("{}: {}", what, cudaGetErrorString(cudaGetLastError())));
    }
    if (!s.ok()) Abort();
    return s;
  }

  Status AllReduce(void* host, size_t bytes, size_t count, ncclDataType_t type, Deadline deadline) {
    if (bytes > kScratchBytes) return InvalidArgument("nccl all-reduce of host data is limited to 256 bytes");
    std::string what = fmt::format("nccl all-reduce of {} elements on {}", count,
                                   DescribeRankOrDefault(options_.describe_rank, options_.rank));
    cudaSetDevice(options_.device);
    WSYNC_CUDA_RETURN(cudaMemcpyAsync(scratch_, host, bytes, cudaMemcpyHostToDevice, stream_), what);
    WSYNC_RETURN_IF_ERROR(Run(what, deadline, [&] {
      return ncclAllReduce(scratch_, scratch_, count, type, ncclSum, comm_, stream_);
    }));
    WSYNC_CUDA_RETURN(cudaMemcpyAsync(host, scratch_, bytes, cudaMemcpyDeviceToHost, stream_), what);
    WSYNC_CUDA_RETURN(cudaStreamSynchronize(stream_), what);
    return Status::Ok();
  }

 public:
  static constexpr size_t kScratchBytes = 256;

 private:
  NcclOptions options_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  void* scratch_;
  std::atomic<bool> aborted_{false};
  std::vector<cudaEvent_t> events_;  // one per piece of a streamed broadcast, reused
};

// "rank 1 (tag 3), rank 2 (tag 0, 4)": the peers of some messages and their tags, for
// errors (NCCL cannot say which message of a group is the one outstanding).
std::string DescribePeers(std::span<const Communicator::PeerMessage> messages, const DescribeRank& describe) {
  std::vector<std::pair<int, std::vector<uint32_t>>> peers;
  for (const auto& m : messages) {
    auto it = std::find_if(peers.begin(), peers.end(), [&](const auto& p) { return p.first == m.peer; });
    if (it == peers.end()) it = peers.insert(peers.end(), {m.peer, {}});
    it->second.push_back(m.tag);
  }
  std::string out;
  for (const auto& [peer, tags] : peers) {
    out += fmt::format("{}{} (tag {})", out.empty() ? "" : ", ", DescribeRankOrDefault(describe, peer),
                       fmt::join(tags, ", "));
  }
  return out.empty() ? "no peer" : out;
}

// One ncclGroupStart/End of sends and receives on the communicator's stream, with an
// event recorded after it.
class NcclPeerBatch final : public Communicator::PeerBatch {
 public:
  // `event` is null when the batch moved nothing.
  NcclPeerBatch(NcclCommunicator* comm, ncclComm_t nccl, int device, cudaEvent_t event, std::string what,
                std::chrono::milliseconds op_timeout)
      : comm_(comm), nccl_(nccl), device_(device), event_(event), what_(std::move(what)), op_timeout_(op_timeout) {}
  ~NcclPeerBatch() override {
    if (event_ == nullptr) return;
    cudaSetDevice(device_);
    // Messages left unfinished would leave their peers waiting.
    if (!result_ && cudaEventQuery(event_) == cudaErrorNotReady) comm_->Abort();
    cudaEventDestroy(event_);
  }

  Status Wait(Deadline deadline) override {
    if (!result_) result_ = WaitOnce(deadline);
    return *result_;
  }

 private:
  Status WaitOnce(Deadline deadline) {
    if (event_ == nullptr) return Status::Ok();
    if (comm_->aborted()) return Aborted(what_ + ": the communicator was aborted (Abort() or a failed call)");
    cudaSetDevice(device_);
    Deadline d = deadline.Min(Deadline::In(op_timeout_));
    Status s = PollComm(nccl_, [&] { return cudaEventQuery(event_) != cudaErrorNotReady; }, d, what_);
    if (s.ok() && cudaEventQuery(event_) != cudaSuccess) {
      s = Internal(fmt::format("{}: {}", what_, cudaGetErrorString(cudaGetLastError())));
    }
    if (!s.ok()) comm_->Abort();
    return s;
  }

  NcclCommunicator* comm_;
  ncclComm_t nccl_;
  int device_;
  cudaEvent_t event_;
  std::string what_;
  std::chrono::milliseconds op_timeout_;
  std::optional<Status> result_;
};

Result<std::unique_ptr<Communicator::PeerBatch>> NcclCommunicator::PostPeerBatch(
    std::span<const PeerMessage> sends, std::span<const PeerMessage> receives) {
  const std::string me = DescribeRankOrDefault(options_.describe_rank, options_.rank);
  for (int pass = 0; pass < 2; ++pass) {
    const bool send = pass == 1;
    for (const PeerMessage& m : send ? sends : receives) {
      if (m.peer < 0 || m.peer >= size() || m.peer == rank()) {
        return InvalidArgument(fmt::format("nccl {} rank {} (tag {}): not a peer of {} in a group of {}",
                                           send ? "send to" : "receive from", m.peer, m.tag, me, size()));
      }
    }
  }
  size_t bytes = 0;
  for (const PeerMessage& m : sends) bytes += m.data.size();
  for (const PeerMessage& m : receives) bytes += m.data.size();
  std::string what = fmt::format("nccl point-to-point on {}: {} bytes in {} sends to [{}] and {} receives from [{}]",
                                 me, bytes, sends.size(), DescribePeers(sends, options_.describe_rank),
                                 receives.size(), DescribePeers(receives, options_.describe_rank));
  if (aborted_) return Aborted(what + ": the communicator was aborted by an earlier failure");
  // Empty messages move nothing and are left out on both ends.
  if (bytes == 0) {
    return std::unique_ptr<PeerBatch>(
        std::make_unique<NcclPeerBatch>(this, comm_, options_.device, nullptr, what, options_.op_timeout));
  }
  cudaSetDevice(options_.device);
  cudaEvent_t event = nullptr;
  WSYNC_CUDA_RETURN(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), what);
  auto batch = std::make_unique<NcclPeerBatch>(this, comm_, options_.device, event, what, options_.op_timeout);
  // The group's messages progress together; receives go first only for symmetry with Gloo.
  ncclResult_t r = ncclGroupStart();
  for (int pass = 0; pass < 2 && r == ncclSuccess; ++pass) {
    const bool send = pass == 1;
    for (const PeerMessage& m : send ? sends : receives) {
      if (m.data.empty()) continue;
      r = send ? ncclSend(m.data.data(), m.data.size(), ncclUint8, m.peer, comm_, stream_)
               : ncclRecv(m.data.data(), m.data.size(), ncclUint8, m.peer, comm_, stream_);
      if (r != ncclSuccess) break;
    }
  }
  ncclResult_t end = ncclGroupEnd();
  if (r == ncclSuccess) r = end;
  Status s = (r == ncclSuccess || r == ncclInProgress) ? Status::Ok() : NcclError(r, what);
  // A non-blocking communicator finishes enqueuing (and connecting to new peers, which
  // waits for them to post their side) before the event can follow the group.
  if (s.ok()) {
    s = PollComm(comm_, [] { return true; }, Deadline::In(options_.op_timeout),
                 what + " (enqueuing; a first message to a peer waits for it to post its side)");
  }
  if (s.ok() && cudaEventRecord(event, stream_) != cudaSuccess) {
    s = Internal(fmt::format("{}: cudaEventRecord: {}", what, cudaGetErrorString(cudaGetLastError())));
  }
  if (!s.ok()) {
    Abort();  // peers may wait for messages of this group
    return s;
  }
  return std::unique_ptr<PeerBatch>(std::move(batch));
}

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

Result<NcclUniqueIdBytes> NewNcclUniqueId() {
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return NcclError(r, "ncclGetUniqueId");
  static_assert(sizeof(id.internal) == kNcclUniqueIdBytes);
  NcclUniqueIdBytes out;
  std::memcpy(out.data(), id.internal, kNcclUniqueIdBytes);
  return out;
}

Result<std::unique_ptr<Communicator>> ConnectNccl(const NcclOptions& o) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return InvalidArgument(fmt::format("nccl rank {} outside group of {}", o.rank, o.size));
  }
  std::string what = fmt::format("nccl init of {} of {} on cuda:{}",
                                 DescribeRankOrDefault(o.describe_rank, o.rank), o.size, o.device);
  WSYNC_CUDA_RETURN(cudaSetDevice(o.device), what);
  cudaStream_t stream = nullptr;
  // The highest priority: the engine packs and unpacks on other streams of the same GPU
  // while the wire runs, and NCCL's blocks should get SMs first.
  int least_priority = 0, greatest_priority = 0;
  WSYNC_CUDA_RETURN(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority), what);
  WSYNC_CUDA_RETURN(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest_priority), what);
  void* scratch = nullptr;
  if (cudaMalloc(&scratch, NcclCommunicator::kScratchBytes) != cudaSuccess) {
    cudaStreamDestroy(stream);
    return Internal(what + ": cudaMalloc of the scratch buffer failed");
  }
  ncclUniqueId id;
  std::memcpy(id.internal, o.unique_id.data(), kNcclUniqueIdBytes);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so that init and every collective can be bounded by a deadline
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, o.size, id, o.rank, &config);
  Status s = (r == ncclSuccess || r == ncclInProgress) ? Status::Ok() : NcclError(r, what);
  if (s.ok()) {
    s = PollComm(comm, [&] {
      ncclResult_t state = ncclInProgress;
      ncclCommGetAsyncError(comm, &state);
      return state == ncclSuccess;
    }, o.connect_deadline, what + " (waiting for every rank to call ncclCommInitRank)");
  }
  if (!s.ok()) {
    if (comm != nullptr) ncclCommAbort(comm);
    cudaFree(scratch);
    cudaStreamDestroy(stream);
    return s;
  }
  return std::unique_ptr<Communicator>(std::make_unique<NcclCommunicator>(o, comm, stream, scratch));
}

}  // namespace wsync
