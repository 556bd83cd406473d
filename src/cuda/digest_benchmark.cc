// `cuda_digest_benchmark`: the device digest kernel (DeviceRuntime::Xxh3Digests) over one
// buffer of device memory cut into spans of several sizes, against reading the same bytes
// back to the host and hashing them there (what a device tensor cost before). One JSON
// line per case on stdout.
#include <chrono>
#include <cstdio>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/digest.h"
#include "cuda/device.h"
#include "cuda/runtime.h"
#include "wsync/device_runtime.h"

namespace wsync::cuda {
namespace {

double Seconds(auto&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int Run(double gib, int reps) {
  if (DeviceCount() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 2;
  }
  InstallDeviceRuntime();
  const Device dev{Device::Kind::kCuda, 0};
  DeviceRuntime* rt = *CudaRuntimeFor(dev);
  (void)rt->SetDevice(0);
  const size_t bytes = static_cast<size_t>(gib * (1 << 30)) / 4096 * 4096;
  Result<DeviceBuffer> buf = DeviceBuffer::Allocate(dev, bytes);
  if (!buf.ok()) {
    std::fprintf(stderr, "%s\n", buf.status().ToString().c_str());
    return 1;
  }
  for (size_t span : {size_t{256} << 10, size_t{1} << 20, size_t{4} << 20, size_t{16} << 20, size_t{64} << 20,
                      bytes}) {
    std::vector<DeviceRuntime::Span> list;
    for (size_t at = 0; at < bytes; at += span) list.push_back({buf->data() + at, std::min(span, bytes - at)});
    std::vector<uint64_t> out(2 * list.size());
    Status s = rt->Xxh3Digests(list, out);  // warm-up
    double best = 1e30;
    for (int r = 0; r < reps && s.ok(); ++r) best = std::min(best, Seconds([&] { s = rt->Xxh3Digests(list, out); }));
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    std::printf("%s\n", fmt::format(R"({{"case": "device", "bytes": {}, "span_bytes": {}, "spans": {}, "seconds": {:.6f}, "gb_per_s": {:.1f}}})",
                                    bytes, span, list.size(), best, bytes / best / 1e9).c_str());
  }
  std::vector<std::byte> scratch;
  TensorRef t;
  t.name = "buffer";
  t.device = dev;
  t.bytes = std::span<const std::byte>(buf->data(), bytes);
  Status read = Status::Ok();
  const double back = Seconds([&] { read = TensorHexDigest(DigestAlgorithm::kXxh3_128, t, scratch).status(); });
  std::printf("%s\n", fmt::format(R"({{"case": "read_back", "bytes": {}, "seconds": {:.6f}, "gb_per_s": {:.1f}}})",
                                  bytes, back, bytes / back / 1e9).c_str());
  return read.ok() ? 0 : 1;
}

}  // namespace
}  // namespace wsync::cuda

int main(int argc, char** argv) {
  CLI::App app{"Times the device digest kernel against a host read-back of the same device bytes."};
  double gib = 1.0;
  int reps = 5;
  app.add_option("--gib", gib, "GiB of device memory to digest")->check(CLI::Range(0.001, 64.0));
  app.add_option("--reps", reps, "timed repetitions per case (the best is printed)")->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);
  return wsync::cuda::Run(gib, reps);
}
