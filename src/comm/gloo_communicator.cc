#include "comm/gloo_communicator.h"

#include <fmt/format.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <unordered_set>
#include <vector>

#include "comm/gloo_tree.h"
#include "comm/store.h"

namespace wsync {
namespace {

using Clock = Deadline::Clock;
using gloo::transport::UnboundBuffer;

std::string HumanBytes(size_t n) {
  if (n >= (size_t{1} << 30)) return fmt::format("{:.2f} GiB", n / double(1 << 30));
  if (n >= (size_t{1} << 20)) return fmt::format("{:.1f} MiB", n / double(1 << 20));
  return fmt::format("{} bytes", n);
}

// Gloo reports a missed wait as "Timed out ..." and a dead peer as a socket error.
bool IsTimeout(std::string_view what) {
  return what.find("Timed out") != std::string_view::npos ||
         what.find("did not appear") != std::string_view::npos ||
         what.find("timeout") != std::string_view::npos;
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const GlooOptions& options, std::shared_ptr<gloo::Context> context)
      : options_(options), context_(std::move(context)) {}

  ~GlooCommunicator() override {
    std::lock_guard<std::mutex> lock(op_mu_);
    context_.reset();
  }

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  std::string_view kind() const override { return "gloo"; }

  Status Broadcast(std::span<std::byte> data, int root, Deadline deadline) override {
    return Broadcast(data, root, deadline, StreamHooks{});
  }
  Status Broadcast(std::span<std::byte> data, int root, Deadline deadline,
                   const StreamHooks& hooks) override;
  Status AllGather(std::span<const std::byte> in, std::span<std::byte> out,
                   Deadline deadline) override;
  Status AllReduceSum(std::span<int64_t> data, Deadline deadline) override {
    return AllReduce<int64_t>(data, "all-reduce(int64)", deadline);
  }
  Status AllReduceSum(std::span<float> data, Deadline deadline) override {
    return AllReduce<float>(data, "all-reduce(float)", deadline);
  }

  Result<std::unique_ptr<PeerBatch>> PostPeerBatch(std::span<const PeerMessage> sends,
                                                   std::span<const PeerMessage> receives) override;

  void Abort() override {
    aborted_ = true;
    WakeInflight();
    // Close the connections now unless a call holds op_mu_; it closes them on exit.
    if (op_mu_.try_lock()) {
      CloseLocked();
      op_mu_.unlock();
    }
  }
  bool aborted() const override { return aborted_; }

 private:
  // Per-call state used to name what a failed wait was waiting for.
  struct Op {
    std::string what;         // "broadcast of 64.0 MiB from rank 0 (...)"
    std::string waiting_for;  // "rank 1 (...) to send piece 3/16"
    Clock::time_point wait_start;
  };

  std::string Name(int r) const { return DescribeRankOrDefault(options_.describe_rank, r); }
  std::chrono::milliseconds WaitTimeout(Deadline deadline) const {
    return std::max(std::chrono::milliseconds(0),
                    std::min(options_.op_timeout, deadline.remaining()));
  }

  class GlooPeerBatch;
  // Buffers that Abort() wakes while a thread waits on them. A buffer is registered
  // before it is posted and unregistered before it is destroyed.
  void Register(std::span<UnboundBuffer* const> bufs) {
    std::lock_guard<std::mutex> lock(inflight_mu_);
    inflight_.insert(bufs.begin(), bufs.end());
  }
  void Unregister(std::span<UnboundBuffer* const> bufs) {
    std::lock_guard<std::mutex> lock(inflight_mu_);
    for (UnboundBuffer* b : bufs) inflight_.erase(b);
  }
  // Makes every pending wait on a registered buffer return false at once.
  void WakeInflight() {
    std::lock_guard<std::mutex> lock(inflight_mu_);
    for (UnboundBuffer* b : inflight_) {
      b->abortWaitRecv();
      b->abortWaitSend();
    }
  }
  // Closes every connection, so that each peer's pending wait on this rank fails at
  // once, and drops the context. Live unbound buffers keep Gloo's transport context
  // (and so the sockets) alive, which is why the pairs are closed explicitly.
  // REQUIRES: op_mu_ held.
  void CloseLocked() {
    if (!context_) return;
    try {
      context_->closeConnections();
    } catch (const std::exception&) {
      // A pair that fails to close is already failed; the context goes regardless.
    }
    context_.reset();
  }
  // The teardown after any failure. REQUIRES: op_mu_ held.
  void AbortLocked() {
    aborted_ = true;
    WakeInflight();
    CloseLocked();
  }

  template <typename Body>
  Status Run(Op& op, Body&& body);
  Status BroadcastChunked(std::span<std::byte> data, int root, Deadline deadline, Op& op,
                          const StreamHooks& hooks);
  Status BroadcastGloo(std::span<std::byte> data, int root, Deadline deadline, Op& op);
  template <typename T>
  Status AllReduce(std::span<T> data, const char* name, Deadline deadline);

  const GlooOptions options_;
  std::atomic<bool> aborted_{false};
  std::mutex op_mu_;                        // one collective at a time
  std::shared_ptr<gloo::Context> context_;  // GUARDED_BY(op_mu_); null once aborted
  uint32_t seq_ = 0;                        // GUARDED_BY(op_mu_); tags successive calls
  std::mutex inflight_mu_;
  std::unordered_set<UnboundBuffer*> inflight_;  // GUARDED_BY(inflight_mu_)
};

template <typename Body>
Status GlooCommunicator::Run(Op& op, Body&& body) {
  auto where = fmt::format("gloo {} on {} of {}", op.what, Name(rank()), size());
  if (aborted_) return Aborted(where + ": communicator was aborted by an earlier failure");
  std::unique_lock<std::mutex> lock(op_mu_);
  if (aborted_ || !context_)
    return Aborted(where + ": communicator was aborted by an earlier failure");
  Status status;
  try {
    status = body();
  } catch (const std::exception& e) {
    double waited = std::chrono::duration<double>(Clock::now() - op.wait_start).count();
    std::string whom = op.waiting_for.empty() ? "the other ranks" : op.waiting_for;
    if (IsTimeout(e.what())) {
      status = DeadlineExceeded(fmt::format(
          "{}: timed out after {:.1f} s waiting for {} [gloo: {}]", where, waited, whom, e.what()));
    } else {
      status = Unavailable(fmt::format("{}: connection failed while waiting for {} [gloo: {}]",
                                       where, whom, e.what()));
    }
  }
  if (status.code() == StatusCode::kAborted) status = Aborted(where + ": " + status.message());
  if (!status.ok() || aborted_) AbortLocked();
  return status;
}

Status GlooCommunicator::Broadcast(std::span<std::byte> data, int root, Deadline deadline,
                                   const StreamHooks& hooks) {
  if (root < 0 || root >= size()) {
    return InvalidArgument(
        fmt::format("gloo broadcast: root {} outside group of {}", root, size()));
  }
  Op op{fmt::format("broadcast of {} from {}", HumanBytes(data.size()), Name(root)), "",
        Clock::now()};
  return Run(op, [&] {
    if (size() == 1 || data.empty()) return Status::Ok();
    if (options_.algorithm == GlooBroadcastAlgorithm::kGlooBaseline) {
      if (rank() == root && hooks.before_send) WSYNC_RETURN_IF_ERROR(hooks.before_send(data.size()));
      WSYNC_RETURN_IF_ERROR(BroadcastGloo(data, root, deadline, op));
      if (rank() != root && hooks.on_received) hooks.on_received(data.size());
      return Status::Ok();
    }
    return BroadcastChunked(data, root, deadline, op, hooks);
  });
}

Status GlooCommunicator::BroadcastChunked(std::span<std::byte> data, int root, Deadline deadline,
                                          Op& op, const StreamHooks& hooks) {
  const BroadcastTree tree = options_.algorithm == GlooBroadcastAlgorithm::kBinomial
                                 ? BinomialTree(rank(), size(), root)
                                 : ChainTree(rank(), size(), root);
  const uint64_t slot = gloo::Slot::build(gloo::kBroadcastSlotPrefix, seq_++);
  const size_t chunk = std::max<size_t>(options_.chunk_bytes, 4096);
  const size_t pieces = (data.size() + chunk - 1) / chunk;

  std::vector<std::unique_ptr<UnboundBuffer>> bufs;
  bufs.reserve(pieces);
  for (size_t k = 0; k < pieces; ++k) {
    size_t off = k * chunk;
    bufs.push_back(
        context_->createUnboundBuffer(data.data() + off, std::min(chunk, data.size() - off)));
  }
  std::vector<UnboundBuffer*> registered;
  for (auto& b : bufs) registered.push_back(b.get());
  Register(registered);
  struct Unregistered {
    GlooCommunicator* self;
    const std::vector<UnboundBuffer*>& bufs;
    ~Unregistered() { self->Unregister(bufs); }
  } unregister{this, registered};
  auto aborted = [&] { return Aborted("Abort() called while waiting for " + op.waiting_for); };
  if (aborted_) return Aborted("Abort() called before the transfer started");

  std::string children;
  for (int child : tree.children) children += (children.empty() ? "" : ", ") + Name(child);
  auto expect = [&](const char* verb, const std::string& who, size_t k) {
    op.waiting_for = fmt::format("{} to {} piece {}/{}", who, verb, k + 1, pieces);
    op.wait_start = Clock::now();
  };
  // Posting every receive up front lets the parent stream pieces without handshakes.
  if (tree.parent >= 0) {
    expect("send", Name(tree.parent), 0);
    for (auto& b : bufs) b->recv(tree.parent, slot);
  }
  for (size_t k = 0; k < pieces; ++k) {
    size_t end = std::min(data.size(), (k + 1) * chunk);
    if (tree.parent >= 0) {
      expect("send", Name(tree.parent), k);
      if (!bufs[k]->waitRecv(WaitTimeout(deadline))) return aborted();
    } else if (hooks.before_send) {
      op.waiting_for = fmt::format("the caller to prepare piece {}/{}", k + 1, pieces);
      WSYNC_RETURN_IF_ERROR(hooks.before_send(end));
    }
    if (!tree.children.empty()) expect("take", children, k);
    for (int child : tree.children) bufs[k]->send(child, slot);
    if (tree.parent >= 0 && hooks.on_received) hooks.on_received(end);
  }
  if (!tree.children.empty()) {
    for (size_t k = 0; k < pieces; ++k) {
      expect("take", children, k);
      for (size_t c = 0; c < tree.children.size(); ++c) {
        if (!bufs[k]->waitSend(WaitTimeout(deadline))) return aborted();
      }
    }
  }
  if (aborted_) return aborted();
  return Status::Ok();
}

// Point-to-point messages go in pieces of at most this many bytes, cut the same way on
// both ends, each one Gloo message on the message's slot. Gloo matches the messages of
// one slot between one pair in posting order, which keeps a message's pieces, and
// messages of equal tags, in order.
constexpr size_t kPeerPieceBytes = size_t{64} << 20;
constexpr uint64_t kPeerSlotPrefix = 0x5e;

// A message's Gloo slot: the prefix (bits 56-63, apart from Gloo's own collectives), the
// tag (bits 24-55) and the message's length folded to 24 bits. A Gloo send longer than
// its receive trips a fatal check on the I/O thread, and a shorter one completes the
// receive short; with the length in the slot such a pair does not match, and the wait
// fails at its deadline instead.
uint64_t PeerSlot(uint32_t tag, size_t bytes) {
  const uint64_t n = bytes;
  const uint64_t folded = (n ^ (n >> 24) ^ (n >> 48)) & 0xffffff;
  return (kPeerSlotPrefix << 56) | (uint64_t{tag} << 24) | folded;
}

// The posted pieces of one PostPeerBatch. Wait() runs on any one thread at a time and
// does not hold op_mu_, so batches and collectives of the same communicator proceed
// side by side; Abort() wakes it through the inflight registry.
class GlooCommunicator::GlooPeerBatch final : public Communicator::PeerBatch {
 public:
  struct Piece {
    std::unique_ptr<UnboundBuffer> buf;
    int peer = 0;
    uint32_t tag = 0;
    bool send = false;
    size_t bytes = 0;  // the whole message's
  };
  GlooPeerBatch(GlooCommunicator* comm, std::vector<Piece> pieces)
      : comm_(comm), pieces_(std::move(pieces)) {
    for (const Piece& p : pieces_) bufs_.push_back(p.buf.get());
  }
  ~GlooPeerBatch() override {
    // Pieces left unfinished would leave their peers half way through a message.
    if (done_ < pieces_.size()) comm_->Abort();
    comm_->Unregister(bufs_);
  }

  // Idempotent: a second call returns the first call's result.
  Status Wait(Deadline deadline) override {
    if (!result_) result_ = WaitAll(deadline);
    return *result_;
  }

 private:
  Status WaitAll(Deadline deadline);

  GlooCommunicator* comm_;
  std::vector<Piece> pieces_;
  std::vector<UnboundBuffer*> bufs_;  // registered with comm_ until destruction
  size_t done_ = 0;                   // pieces_[0, done_) completed
  std::optional<Status> result_;
};

Status GlooCommunicator::GlooPeerBatch::WaitAll(Deadline deadline) {
  for (; done_ < pieces_.size(); ++done_) {
    const Piece& p = pieces_[done_];
    auto describe = [&] {
      return fmt::format("gloo point-to-point on {}: {} {} {} {} (tag {})", comm_->Name(comm_->rank()),
                         p.send ? "sending" : "receiving", HumanBytes(p.bytes), p.send ? "to" : "from",
                         comm_->Name(p.peer), p.tag);
    };
    if (comm_->aborted_) {
      return Aborted(describe() + ": the communicator was aborted (Abort() or a failed transfer)");
    }
    const auto started = Clock::now();
    bool completed = false;
    std::string error;
    try {
      const std::chrono::milliseconds timeout = comm_->WaitTimeout(deadline);
      completed = p.send ? p.buf->waitSend(timeout) : p.buf->waitRecv(timeout);
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (completed) continue;
    comm_->Abort();
    if (error.empty()) {
      return Aborted(describe() + ": the communicator was aborted (Abort() or a failed transfer) while waiting");
    }
    if (error.find("Application timeout caused pair closure") != std::string::npos) {
      return Aborted(fmt::format("{}: another wait on this communicator timed out [gloo: {}]", describe(), error));
    }
    if (IsTimeout(error)) {
      const double waited = std::chrono::duration<double>(Clock::now() - started).count();
      return DeadlineExceeded(fmt::format("{}: timed out after {:.1f} s waiting for {} to {} it{} [gloo: {}]",
                                          describe(), waited, comm_->Name(p.peer), p.send ? "receive" : "send",
                                          p.send ? "" : " (a send of another length does not match)", error));
    }
    return Unavailable(fmt::format("{}: connection to {} failed [gloo: {}]", describe(), comm_->Name(p.peer), error));
  }
  return Status::Ok();
}

Result<std::unique_ptr<Communicator::PeerBatch>> GlooCommunicator::PostPeerBatch(
    std::span<const PeerMessage> sends, std::span<const PeerMessage> receives) {
  size_t count = 0;
  for (int pass = 0; pass < 2; ++pass) {
    const bool send = pass == 1;
    for (const PeerMessage& m : send ? sends : receives) {
      if (m.peer < 0 || m.peer >= size() || m.peer == rank()) {
        return InvalidArgument(fmt::format("gloo {} rank {} (tag {}): not a peer of {} in a group of {}",
                                           send ? "send to" : "receive from", m.peer, m.tag, Name(rank()),
                                           size()));
      }
      count += (m.data.size() + kPeerPieceBytes - 1) / kPeerPieceBytes;
    }
  }
  std::lock_guard<std::mutex> lock(op_mu_);
  if (aborted_ || !context_) {
    return Aborted(fmt::format("gloo point-to-point on {}: communicator was aborted by an earlier failure",
                               Name(rank())));
  }
  std::vector<GlooPeerBatch::Piece> pieces;
  pieces.reserve(count);
  std::optional<std::string> error;
  std::string posting;  // "sending to rank 5 (...)": the message being posted
  try {
    // Receives first: a peer's sends then find them posted. An empty message moves
    // nothing and posts nothing, on both ends.
    for (int pass = 0; pass < 2; ++pass) {
      const bool send = pass == 1;
      for (const PeerMessage& m : send ? sends : receives) {
        posting = fmt::format("{} {}", send ? "sending to" : "receiving from", Name(m.peer));
        const uint64_t slot = PeerSlot(m.tag, m.data.size());
        for (size_t off = 0; off < m.data.size(); off += kPeerPieceBytes) {
          const size_t n = std::min(kPeerPieceBytes, m.data.size() - off);
          pieces.push_back({context_->createUnboundBuffer(m.data.data() + off, n), m.peer, m.tag, send,
                            m.data.size()});
          UnboundBuffer* buf = pieces.back().buf.get();
          Register({&buf, 1});
          if (send) {
            buf->send(m.peer, slot);
          } else {
            buf->recv(m.peer, slot);
          }
        }
      }
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (error || aborted_) {
    // Abort() from another thread while this call held op_mu_ left the connections to
    // it. The pieces are dropped here rather than by a batch, whose destructor would
    // call Abort() under op_mu_.
    for (const auto& p : pieces) {
      UnboundBuffer* buf = p.buf.get();
      Unregister({&buf, 1});
    }
    AbortLocked();
    if (error) {
      return Unavailable(fmt::format("gloo point-to-point on {}: posting failed{}{} [gloo: {}]", Name(rank()),
                                     posting.empty() ? "" : ", ", posting, *error));
    }
    return Aborted(fmt::format("gloo point-to-point on {}: Abort() called while posting", Name(rank())));
  }
  return std::unique_ptr<PeerBatch>(std::make_unique<GlooPeerBatch>(this, std::move(pieces)));
}

Status GlooCommunicator::BroadcastGloo(std::span<std::byte> data, int root, Deadline deadline,
                                       Op& op) {
  constexpr size_t kMaxCall = size_t{1} << 30;
  for (size_t off = 0; off < data.size(); off += kMaxCall) {
    size_t n = std::min(kMaxCall, data.size() - off);
    gloo::BroadcastOptions opts(context_);
    opts.setOutput(reinterpret_cast<uint8_t*>(data.data() + off), n);
    opts.setRoot(root);
    opts.setTag(seq_++);
    opts.setTimeout(WaitTimeout(deadline));
    op.waiting_for = rank() == root ? "the other ranks" : Name(root) + " or its relay";
    op.wait_start = Clock::now();
    gloo::broadcast(opts);
    if (aborted_) return Aborted("Abort() called during gloo::broadcast");
  }
  return Status::Ok();
}

Status GlooCommunicator::AllGather(std::span<const std::byte> in, std::span<std::byte> out,
                                   Deadline deadline) {
  const size_t n = in.size();
  if (out.size() != n * static_cast<size_t>(size())) {
    return InvalidArgument(fmt::format("gloo all-gather: output of {} bytes is not {} x {}",
                                       out.size(), size(), n));
  }
  // gloo::allgather's ring carries whole per-rank slices in one message; past 1 GiB the
  // chunked broadcasts of the default take over.
  if (n > (size_t{1} << 30)) return Communicator::AllGather(in, out, deadline);
  Op op{fmt::format("all-gather of {} per rank", HumanBytes(n)), "", Clock::now()};
  return Run(op, [&] {
    if (n == 0) return Status::Ok();
    if (size() == 1) {
      std::copy(in.begin(), in.end(), out.begin());
      return Status::Ok();
    }
    gloo::AllgatherOptions opts(context_);
    opts.setInput(reinterpret_cast<uint8_t*>(const_cast<std::byte*>(in.data())), n);
    opts.setOutput(reinterpret_cast<uint8_t*>(out.data()), out.size());
    opts.setTag(seq_++);
    opts.setTimeout(WaitTimeout(deadline));
    op.waiting_for = "the other ranks";
    op.wait_start = Clock::now();
    gloo::allgather(opts);
    if (aborted_) return Aborted("Abort() called during the all-gather");
    return Status::Ok();
  });
}

template <typename T>
Status GlooCommunicator::AllReduce(std::span<T> data, const char* name, Deadline deadline) {
  Op op{fmt::format("{} of {} elements", name, data.size()), "", Clock::now()};
  return Run(op, [&] {
    if (size() == 1 || data.empty()) return Status::Ok();
    gloo::AllreduceOptions opts(context_);
    opts.setInput(data.data(), data.size());
    opts.setOutput(data.data(), data.size());
    opts.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<T>));
    opts.setTag(seq_++);
    opts.setTimeout(WaitTimeout(deadline));
    op.waiting_for = "the other ranks";
    op.wait_start = Clock::now();
    gloo::allreduce(opts);
    if (aborted_) return Aborted("Abort() called during the all-reduce");
    return Status::Ok();
  });
}

}  // namespace

Result<std::unique_ptr<Communicator>> ConnectGloo(const GlooOptions& o) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return InvalidArgument(fmt::format("gloo: rank {} outside group of {}", o.rank, o.size));
  }
  if (o.prefix.empty()) return InvalidArgument("gloo: options.prefix is required");
  auto name = [&](int r) { return DescribeRankOrDefault(o.describe_rank, r); };
  auto where = fmt::format("gloo connect of {} of {} (store http://{}:{}, prefix '{}')",
                           name(o.rank), o.size, o.store_host, o.store_port, o.prefix);
  // connectFullMesh writes "rank_<r>" (hostname) then "<r>" (pair addresses) per rank.
  auto rank_of_key = [](const std::string& key) {
    std::string digits = key.rfind("rank_", 0) == 0 ? key.substr(5) : key;
    return digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos
               ? -1
               : std::stoi(digits);
  };
  HttpStore store(o.store_host, o.store_port, o.prefix, o.connect_deadline,
                  [&](const std::string& key) {
                    int r = rank_of_key(key);
                    return r < 0 ? key : fmt::format("key '{}': {}", key, name(r));
                  });
  auto started = Clock::now();
  try {
    gloo::transport::tcp::attr attr(o.bind_host.c_str());
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(o.rank, o.size);
    context->setTimeout(std::max(std::chrono::milliseconds(1), o.connect_deadline.remaining()));
    context->connectFullMesh(store, device);
    context->setTimeout(o.op_timeout);
    return std::unique_ptr<Communicator>(std::make_unique<GlooCommunicator>(o, std::move(context)));
  } catch (const std::exception& e) {
    double waited = std::chrono::duration<double>(Clock::now() - started).count();
    // Name the ranks that never published their addresses.
    std::vector<std::string> keys;
    for (int r = 0; r < o.size; ++r) {
      if (r != o.rank) keys.push_back(std::to_string(r));
    }
    std::string absent;
    auto missing = store.client().Missing(keys, Deadline::InSeconds(2));
    if (missing.ok()) {
      for (const auto& k : *missing) absent += (absent.empty() ? "" : ", ") + name(rank_of_key(k));
    }
    std::string msg = fmt::format("{}: failed after {:.1f} s", where, waited);
    if (!absent.empty()) msg += "; never joined: " + absent;
    msg += fmt::format(" [gloo: {}]", e.what());
    if (IsTimeout(e.what()) || o.connect_deadline.expired()) return DeadlineExceeded(msg);
    return Unavailable(msg);
  }
}

}  // namespace wsync
