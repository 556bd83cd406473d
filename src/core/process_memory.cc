#include "core/process_memory.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

namespace wsync {
namespace {

std::atomic<int64_t> g_device_live{0};
std::atomic<int64_t> g_device_peak{0};

// A "Field:   N kB" line of /proc/self/status, in bytes; 0 when absent.
int64_t StatusKbField(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t len = std::strlen(field);
  while (std::getline(in, line)) {
    if (line.size() > len && line.compare(0, len, field) == 0 && line[len] == ':') {
      try {
        return std::stoll(line.substr(len + 1)) * 1024;
      } catch (...) {
        return 0;
      }
    }
  }
  return 0;
}

void RaisePeak(int64_t value) {
  int64_t seen = g_device_peak.load();
  while (value > seen && !g_device_peak.compare_exchange_weak(seen, value)) {
  }
}

}  // namespace

int64_t HostRssBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

int64_t HostPeakRssBytes() { return StatusKbField("VmHWM"); }

void NoteDeviceBytes(int64_t delta) { RaisePeak(g_device_live.fetch_add(delta) + delta); }

int64_t DeviceLiveBytes() { return g_device_live.load(); }

MemoryWindow::MemoryWindow() {
  // Resets VmHWM to the current RSS (Linux 4.0+); a refused reset leaves the lifetime peak.
  if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    host_reset_ = std::fputs("5", f) >= 0;
    host_reset_ = std::fclose(f) == 0 && host_reset_;
  }
  host_start_ = HostRssBytes();
  device_start_ = g_device_live.load();
  g_device_peak.store(device_start_);
  RaisePeak(g_device_live.load());
}

MemoryPeak MemoryWindow::Peak() const {
  MemoryPeak p;
  p.host_bytes = std::max<int64_t>(0, HostPeakRssBytes() - host_start_);
  p.device_bytes = std::max<int64_t>(0, g_device_peak.load() - device_start_);
  p.host_exact = host_reset_;
  return p;
}

}  // namespace wsync
