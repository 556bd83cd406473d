#include "backends/ipc/packer.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "core/digest.h"
#include "core/log.h"
#include "core/parallel.h"
#include "engine/device_digests.h"
#include "wsync/device_runtime.h"

namespace wsync {
namespace {

// Copies one tensor into the slot, on several threads when it is large. With a `hasher`
// (in-line verification), the bytes read are hashed too: as they are copied, on one
// thread; or, a large tensor on more than two threads, by the calling thread while the
// others copy.
void CopyInto(std::byte* dst, std::span<const std::byte> src, size_t threads, Hasher* hasher = nullptr) {
  constexpr size_t kPiece = size_t{8} << 20;
  if (src.size() < 2 * kPiece || threads <= 1 || (hasher != nullptr && threads <= 2)) {
    if (hasher != nullptr) {
      CopyAndHash(dst, src, *hasher, /*hash_destination=*/false);
    } else {
      std::memcpy(dst, src.data(), src.size());
    }
    return;
  }
  size_t pieces = (src.size() + kPiece - 1) / kPiece;
  auto copy = [&](size_t b, size_t e) {
    size_t from = b * kPiece, to = std::min(src.size(), e * kPiece);
    std::memcpy(dst + from, src.data() + from, to - from);
  };
  if (hasher == nullptr) {
    ParallelFor(pieces, threads, copy);
    return;
  }
  std::thread copier([&] { ParallelFor(pieces, threads - 1, copy); });
  hasher->Update(src);
  copier.join();
}

}  // namespace

Status IpcPacker::Go(IpcSession& session, const IpcUpdateInfo& u, uint64_t bytes,
                     const std::function<Status()>& check, Deadline deadline) {
  if (u.chunk_ends.empty()) return Status::Ok();
  WSYNC_RETURN_IF_ERROR(SynchronizeIpcDevice(options_.device).WithContext("finishing the trainer's writes"));
  uint64_t seq = u.first_seq;
  Status free = session.WaitSlotFree(seq, deadline, check);
  if (!free.ok()) return free.WithContext(fmt::format("waiting to publish the zero-copy go of sync {}", u.sync));
  session.Publish(seq, 0);
  if (options_.progress) options_.progress(SyncProgress{bytes, bytes, 1, 1});
  Published();
  return Status::Ok();
}

// Chunk k of a GPU sync into `slot`: tensors inside the storage their source offers on
// the trainer's device in one cached batched copy (their addresses are stable); anything
// else tensor by tensor, finished before the stream's next tensor (a TensorRef is only
// valid until then).
Status IpcPacker::PackDevice(IpcSession& session, TensorStream& stream, const std::optional<SourceStorage>& storage,
                             StorageLayoutRecorder& learn, const std::vector<TensorMeta>& meta, const IpcPlan& plan,
                             size_t k, int slot, SyncProgress& p) {
  WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(options_.device));
  std::byte* base = session.staging()->data() + static_cast<uint64_t>(slot) * session.region()->slot_stride();
  DeviceCopyCache::Copies copies;
  TensorRef t;
  for (size_t i = k == 0 ? 0 : plan.chunk_ends[k - 1]; i < plan.chunk_ends[k]; ++i) {
    WSYNC_ASSIGN_OR_RETURN(bool more, stream.Next(&t));
    if (!more) return Internal(fmt::format("source ended before tensor {}", meta[i].name));
    std::byte* dst = base + plan.tensor_offsets[i];
    learn.Add(meta[i], t);
    if (storage && OffsetInStorage(*storage, t)) {
      copies.push_back({t.bytes.data(), dst, t.bytes.size()});
    } else {
      WSYNC_RETURN_IF_ERROR(rt->Copy2D(dst, 0, t.bytes.data(), 0, t.bytes.size(), 1));
      WSYNC_RETURN_IF_ERROR(FinishCopiesFrom(*rt, t, storage).status());
    }
    p.bytes_done += t.bytes.size();
  }
  if (copies.empty()) return Status::Ok();
  WSYNC_ASSIGN_OR_RETURN(DeviceCopies * c,
                         pack_cache_.Get(options_.device, k * kIpcMaxSlots + static_cast<size_t>(slot), copies));
  return c->Run().WithContext(fmt::format("packing chunk {}/{} on {}", k + 1, plan.chunk_ends.size(),
                                          options_.device.ToString()));
}

Status IpcPacker::Pack(IpcSession& session, SyncPass& pass, const IpcPlan& plan, const IpcUpdateInfo& u,
                       ZeroCopyPlanner& zero_copy, PassDigests* digests, const std::function<Status()>& check,
                       Deadline deadline) {
  const std::vector<TensorMeta>& meta = pass.metadata();
  const bool gpu = session.staging() != nullptr;
  WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> stream, pass.Stream());
  std::string why;
  const std::optional<SourceStorage> storage = zero_copy.Exportable(pass.source(), &why);
  StorageLayoutRecorder learn(storage, meta.size());
  IpcRegion& region = *session.region();
  size_t threads = DefaultThreads();
  size_t n = plan.chunk_ends.size();
  SyncProgress p{0, plan.payload_bytes, 0, n};
  for (size_t k = 0; k < n; ++k) {
    uint64_t seq = u.first_seq + k;
    Status free = session.WaitSlotFree(seq, deadline, check);
    if (!free.ok()) {
      return free.WithContext(fmt::format("waiting for a free staging slot for chunk {}/{} of sync {}", k + 1, n, u.sync));
    }
    int slot_index = static_cast<int>(seq % region.num_slots());
    if (gpu) {
      WSYNC_RETURN_IF_ERROR(PackDevice(session, *stream, storage, learn, meta, plan, k, slot_index, p));
    } else {
      std::span<std::byte> slot = region.slot(slot_index);
      TensorRef t;
      for (size_t i = u.chunk_first(k); i < u.chunk_ends[k]; ++i) {
        WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
        if (!more) return Internal(fmt::format("source ended before tensor {}", meta[i].name));
        if (!t.device.is_cpu()) {
          return InvalidArgument(fmt::format("tensor {} is on {}, but this ipc trainer stages in host memory "
                                             "(device cpu); give the trainer the tensors' device",
                                             meta[i].name, t.device.ToString()));
        }
        std::unique_ptr<Hasher> hasher = digests ? Hasher::Create(DigestAlgorithm::kXxh3_128) : nullptr;
        CopyInto(slot.data() + plan.tensor_offsets[i], t.bytes, threads, hasher.get());
        if (hasher) digests->Record(t.name, hasher->FinishHex());
        p.bytes_done += t.bytes.size();
      }
    }
    if (k + 1 == n) {
      // The end of the pass, before the last chunk goes out: a source that yields more
      // than its metadata fails the sync naming the extra tensor.
      TensorRef end;
      WSYNC_RETURN_IF_ERROR(stream->Next(&end).status());
      zero_copy.Learn(learn.Finish(), storage.has_value());
    }
    session.Publish(seq, plan.chunk_bytes[k]);
    if (gpu && digests) {
      // Digested while its readers land it (both only read the slot); the packer writes
      // the slot again only after they have released it.
      const std::byte* base = session.staging()->data() + static_cast<uint64_t>(slot_index) * region.slot_stride();
      std::vector<DeviceTensorBytes> packed;
      for (size_t i = u.chunk_first(k); i < u.chunk_ends[k]; ++i) packed.push_back({&meta[i], base + plan.tensor_offsets[i]});
      WSYNC_RETURN_IF_ERROR(RecordDeviceDigests(options_.device, packed, *digests));
    }
    p.chunks_done = k + 1;
    if (options_.progress) options_.progress(p);
    Published();
  }
  return Status::Ok();
}

void IpcPacker::Published() {
  ++chunks_published_;
  if (ipc_.stall_after_chunks && chunks_published_ == *ipc_.stall_after_chunks) Stall();
}

void IpcPacker::Stall() {
  WSYNC_LOG_WARN("fault injection: stalling after chunk {} until killed", chunks_published_);
  std::fprintf(stderr, "wsync ipc fault injection: stalled after %zu chunk(s)\n", chunks_published_);
  std::fflush(stderr);
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

}  // namespace wsync
