// Fuzz target: an ipc control region as a receiver finds it in shared memory. The input
// is the file: byte 0 picks helpers (bit 0: write the right magic and layout version,
// bit 1: write the file's true size as total_bytes), bytes 1..2 its size in 4 KiB pages
// (sparse), the rest its first bytes. The region is a sealed memfd, as a trainer makes
// it; the init_info repeats what the header says, so that every check of Open is reached.
// Whatever Open accepts must keep every slot, publisher and reader line inside the
// mapping, and the receiver's calls must stay inside it too.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backends/ipc/region.h"
#include "core/checked_math.h"

namespace {

template <typename T>
T At(const std::vector<uint8_t>& file, size_t at) {
  T v{};
  if (at + sizeof(T) <= file.size()) std::memcpy(&v, file.data() + at, sizeof(T));
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace wsync;
  if (size < 3) return 0;
  const uint8_t flags = data[0];
  const uint64_t pages = std::clamp<uint64_t>(data[1] | (uint64_t{data[2]} << 8), 1, 4096);
  const uint64_t file_bytes = pages * 4096;
  std::vector<uint8_t> head(data + 3, data + std::min<size_t>(size, 3 + file_bytes));
  head.resize(std::max<size_t>(head.size(), 4096));
  if (flags & 1) {
    const uint64_t magic = 0x4350494353595357ull;
    const uint32_t version = 3;
    std::memcpy(head.data(), &magic, 8);
    std::memcpy(head.data() + 8, &version, 4);
  }
  if (flags & 2) std::memcpy(head.data() + 40, &file_bytes, 8);

  int fd = memfd_create("wsync-ipc-fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return 0;
  if (ftruncate(fd, static_cast<off_t>(file_bytes)) != 0 ||
      pwrite(fd, head.data(), head.size(), 0) != static_cast<ssize_t>(head.size()) ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    close(fd);
    return 0;
  }
  IpcInitInfo info;
  info.session = std::string(reinterpret_cast<const char*>(head.data()) + 60, 32);
  info.control_path = "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(fd);
  info.control_bytes = At<uint64_t>(head, 40);
  info.num_slots = static_cast<int>(At<uint32_t>(head, 12));
  info.slot_bytes = At<uint64_t>(head, 16);
  info.reader_count = static_cast<int>(At<uint32_t>(head, 48));
  auto opened = IpcRegion::Open(info);
  if (opened.ok()) {
    IpcRegion& r = **opened;
    if (r.num_slots() < 1 || r.num_slots() > kIpcMaxSlots || r.reader_count() < 1 || r.publisher_count() < 1 ||
        r.bytes() != file_bytes) {
      std::abort();
    }
    for (int k = 0; k < r.num_slots(); ++k) {
      std::span<std::byte> slot = r.slot(k);
      if (slot.empty()) continue;
      std::optional<uint64_t> begin = CheckedMulAdd(r.slot_stride(), k, r.header_bytes());
      if (!begin || !RangeWithin(*begin, slot.size(), r.bytes())) std::abort();
      volatile std::byte first = slot.front(), last = slot.back();
      (void)first;
      (void)last;
    }
    (void)r.Announced();
    (void)r.AbortedReason(At<uint64_t>(head, 192));
    for (int reader = 0; reader < std::min(r.reader_count(), 8); ++reader) {
      (void)r.acked(reader);
      (void)r.reader_publisher(reader);
      r.Attach(reader, 1, std::min(r.publisher_count() - 1, 1));
      r.Ack(reader, 1);
    }
    for (int p = 0; p < std::min(r.publisher_count(), 4); ++p) {
      (void)r.WaitPublished(At<uint64_t>(head, 4096 - 8) | 1, 1, Deadline::InSeconds(0), "fuzz", p);
    }
    (void)r.CheckStillMapped();
  }
  close(fd);
  return 0;
}
