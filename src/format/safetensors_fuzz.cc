// Fuzz target: the bytes of a safetensors file (header length, JSON header, tensor
// layout, data). Open() either refuses the file or yields tensors whose element and byte
// counts are defined and whose bytes lie inside the mapping, in ascending offset order
// without overlap.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "format/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A memory-backed file: no disk traffic, and a path Open() can map.
  static const int fd = memfd_create("safetensors_fuzz", MFD_CLOEXEC);
  if (fd < 0) std::abort();
  if (ftruncate(fd, 0) != 0 || (size > 0 && pwrite(fd, data, size, 0) != static_cast<ssize_t>(size))) std::abort();
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  wsync::Result<wsync::SafetensorsFile> f = wsync::SafetensorsFile::Open(path);
  if (!f.ok()) return 0;
  const std::byte* prev_end = nullptr;
  for (size_t i = 0; i < f->tensors().size(); ++i) {
    const wsync::TensorMeta& m = f->tensors()[i];
    if (m.numel() < 0) std::abort();
    std::span<const std::byte> b = f->BytesAt(i);
    if (b.size() != m.nbytes()) std::abort();
    if (!b.empty()) {
      if (prev_end != nullptr && b.data() < prev_end) std::abort();
      prev_end = b.data() + b.size();
      // Touch the first and last byte: inside the mapping or ASan/SEGV says so.
      volatile std::byte first = b.front(), last = b.back();
      (void)first;
      (void)last;
    }
    if (!f->Bytes(m.name).ok()) std::abort();
  }
  return 0;
}
