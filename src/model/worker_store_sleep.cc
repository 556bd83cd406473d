// WorkerStore's sleep and wake: releasing the parameters' memory in place and bringing it
// back (worker_store.h says what each level keeps).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <mutex>

#include <fmt/format.h>

#include "core/parallel.h"
#include "core/prefault.h"
#include "core/syscall.h"
#include "model/worker_store.h"

namespace wsync {
namespace {

// A slice of one parameter and where it lies in the offload file (parameters back to
// back, in table order).
struct FileRange {
  std::byte* data;
  size_t bytes;
  uint64_t offset;
};

std::vector<FileRange> FileRanges(std::vector<HostTensor>& params) {
  constexpr size_t kRange = size_t{64} << 20;
  std::vector<FileRange> out;
  uint64_t offset = 0;
  for (HostTensor& t : params) {
    std::byte* data = t.storage.data();
    const size_t n = t.meta.nbytes();
    for (size_t off = 0; off < n; off += kRange) out.push_back({data + off, std::min(kRange, n - off), offset + off});
    offset += n;
  }
  return out;
}

// Runs fn on every range on up to `threads` threads; the first failure.
Status ForEachRange(const std::vector<FileRange>& ranges, size_t threads,
                    const std::function<Status(const FileRange&)>& fn) {
  std::mutex mu;
  Status first;  // guarded by mu
  ParallelFor(ranges.size(), threads, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      Status s = fn(ranges[i]);
      if (!s.ok()) {
        std::lock_guard lock(mu);
        if (first.ok()) first = std::move(s);
        return;
      }
    }
  });
  return first;
}

}  // namespace

Status WorkerStore::CheckResident(std::string_view what) const {
  Residency r = residency();
  if (r == Residency::kResident) return Status::Ok();
  return FailedPrecondition(fmt::format("{}: the parameters of tp rank {} on {} are {} (the server sleeps; wake "
                                        "its weights first)", what, tp_rank(), device_.ToString(),
                                        r == Residency::kOffloaded ? "offloaded" : "discarded"));
}

size_t WorkerStore::resident_bytes() const {
  if (!device_.is_cpu()) return residency() == Residency::kResident ? param_bytes_ : 0;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size_t n = 0;
  for (const HostTensor& t : params_) {
    long pages = ResidentPages(t.storage.span());
    if (pages < 0) return param_bytes_;  // the kernel cannot say: count it all
    n += std::min(static_cast<size_t>(pages) * page, t.meta.nbytes());
  }
  return n;
}

Status WorkerStore::Offload(const std::string& offload_dir, size_t threads) {
  if (residency() != Residency::kResident) return Status::Ok();
  const std::string where = fmt::format("offloading the parameters of tp rank {} ({} bytes)", tp_rank(), param_bytes_);
  if (!device_.is_cpu()) {
    WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device_));
    WSYNC_ASSIGN_OR_RETURN(HostBuffer host, HostBuffer::Allocate(device_storage_.size()));
    // Fresh pages faulted in on many threads first: the driver's copy into pageable memory
    // would otherwise take every page fault on one thread.
    Prefault(host.span(), threads);
    WSYNC_RETURN_IF_ERROR(rt->Copy2D(host.data(), host.size(), device_storage_.data(), host.size(), host.size(), 1));
    WSYNC_RETURN_IF_ERROR(rt->Synchronize().WithContext(fmt::format("{} from {} to host memory", where, device_.ToString())));
    WSYNC_RETURN_IF_ERROR(device_storage_.ReleasePhysical().WithContext(where));
    offload_host_ = std::move(host);
    offloaded_bytes_.store(param_bytes_, std::memory_order_release);
    residency_.store(Residency::kOffloaded, std::memory_order_release);
    return Status::Ok();
  }
  Result<std::unique_ptr<OffloadFile>> file = OffloadFile::Create(offload_dir, param_bytes_);
  if (!file.ok()) return file.status().WithContext(where);
  const std::vector<FileRange> ranges = FileRanges(params_);
  WSYNC_RETURN_IF_ERROR(ForEachRange(ranges, threads, [&](const FileRange& r) {
                          return (*file)->Write(r.offset, {r.data, r.bytes});
                        }).WithContext(where));
  offload_file_ = std::move(*file);
  offloaded_bytes_.store(param_bytes_, std::memory_order_release);
  residency_.store(Residency::kOffloaded, std::memory_order_release);
  // The bytes are safe in the file: from here the store is offloaded whatever happens.
  for (HostTensor& t : params_) {
    if (t.storage.size() == 0) continue;
    WSYNC_SYSCALL(madvise(t.storage.data(), t.storage.size(), MADV_DONTNEED),
                  fmt::format("releasing the memory of {} (its bytes are offloaded)", t.meta.name));
  }
  return Status::Ok();
}

Status WorkerStore::Discard() {
  if (residency() == Residency::kDiscarded) return Status::Ok();
  for (std::string& d : landed_) d.clear();  // the bytes they cover are gone
  const std::string where = fmt::format("discarding the parameters of tp rank {}", tp_rank());
  if (!device_.is_cpu()) {
    WSYNC_RETURN_IF_ERROR(device_storage_.ReleasePhysical().WithContext(where));
  } else {
    for (HostTensor& t : params_) {
      if (t.storage.size() == 0) continue;
      WSYNC_SYSCALL(madvise(t.storage.data(), t.storage.size(), MADV_DONTNEED),
                    fmt::format("{}: releasing the memory of {}", where, t.meta.name));
    }
  }
  residency_.store(Residency::kDiscarded, std::memory_order_release);
  offloaded_bytes_.store(0, std::memory_order_release);
  offload_file_.reset();
  offload_host_ = HostBuffer();
  return Status::Ok();
}

Status WorkerStore::Restore(size_t threads) {
  const Residency from = residency();
  if (from == Residency::kResident) return Status::Ok();
  const std::string where = fmt::format("waking the parameters of tp rank {} ({} bytes)", tp_rank(), param_bytes_);
  Status copied;
  if (!device_.is_cpu()) {
    WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device_));
    WSYNC_RETURN_IF_ERROR(device_storage_.RestorePhysical().WithContext(fmt::format("{} on {}", where, device_.ToString())));
    residency_.store(Residency::kResident, std::memory_order_release);
    if (from == Residency::kOffloaded) {
      copied = rt->Copy2D(device_storage_.data(), offload_host_.size(), offload_host_.data(), offload_host_.size(),
                          offload_host_.size(), 1);
      if (copied.ok()) copied = rt->Synchronize();
    }
  } else {
    for (HostTensor& t : params_) Prefault(t.storage.span(), threads);
    residency_.store(Residency::kResident, std::memory_order_release);
    if (from == Residency::kOffloaded) {
      copied = ForEachRange(FileRanges(params_), threads,
                            [&](const FileRange& r) { return offload_file_->Read(r.offset, {r.data, r.bytes}); });
    }
  }
  offloaded_bytes_.store(0, std::memory_order_release);
  offload_file_.reset();
  offload_host_ = HostBuffer();
  if (!copied.ok()) {
    return DataLoss(fmt::format("{}: the offloaded bytes could not be copied back ({}); the memory is back but its "
                                "bytes are incomplete, as if discarded", where, copied.ToString()));
  }
  return Status::Ok();
}

}  // namespace wsync
