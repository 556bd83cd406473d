// This process's memory, for the "peak extra memory" that syncs and verifications report.
//
// Host: the kernel's resident set (VmRSS) and its high-water mark (VmHWM), which Linux
// lets a process reset to the current RSS (/proc/self/clear_refs, "5").
// Device: the bytes wsync itself allocates on GPUs (the CUDA runtime of src/cuda and its
// exported allocations call NoteDeviceBytes), live and at peak. Memory that CUDA, NCCL
// or a framework allocate on their own (contexts, communicator buffers) is not counted.
#pragma once

#include <cstdint>

namespace wsync {

// Resident set size; 0 when /proc is unreadable.
int64_t HostRssBytes();
// Peak resident set size since the process started or the last reset; 0 when unreadable.
int64_t HostPeakRssBytes();

// Adds `delta` bytes (negative on free) to the live device bytes, updating the peak.
void NoteDeviceBytes(int64_t delta);
int64_t DeviceLiveBytes();

// Peak memory above a window's starting point. A window resets the process-wide peaks
// when it starts, so windows must not overlap (an inner window under-reports the outer
// one); each sync or verification opens one at its start.
struct MemoryPeak {
  int64_t host_bytes = 0;    // peak RSS minus RSS at the start (0 if below)
  int64_t device_bytes = 0;  // peak live device bytes minus live bytes at the start
  // False when the kernel refused the reset: host_bytes is then measured against the
  // peak since the process started and may over-report.
  bool host_exact = true;

  // Widens this peak to cover `other` too (the larger of each figure).
  void Include(const MemoryPeak& other) {
    host_bytes = host_bytes > other.host_bytes ? host_bytes : other.host_bytes;
    device_bytes = device_bytes > other.device_bytes ? device_bytes : other.device_bytes;
    host_exact = host_exact && other.host_exact;
  }
};

class MemoryWindow {
 public:
  // Starts the window now.
  MemoryWindow();
  // The peaks so far.
  MemoryPeak Peak() const;

 private:
  int64_t host_start_ = 0;
  int64_t device_start_ = 0;
  bool host_reset_ = false;
};

}  // namespace wsync
