// Micro-benchmark of in-line verification's hashing on one thread: what xxh3-128 adds
// to the copy a data plane makes anyway, hashed in a separate pass (before or after the
// copy) or fused with it (CopyAndHash: each block hashed right after it is copied). Times
// are this thread's CPU time, best of `reps`, i.e. per-core cost whatever else shares the
// machine; source and destination are prefaulted buffers of `MiB` each.
//
//   digest_benchmark [MiB=1192] [reps=7]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/digest.h"
#include "core/stopwatch.h"

namespace {

template <typename F>
double BestSeconds(int reps, F&& f) {
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    double t = wsync::ThreadCpuSeconds();
    f();
    best = std::min(best, wsync::ThreadCpuSeconds() - t);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  using wsync::DigestAlgorithm;
  const size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 1192;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 7;
  const size_t n = mib << 20;
  std::vector<std::byte> src(n), dst(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = i * 0x9e3779b97f4a7c15ull;
    std::memcpy(src.data() + i, &v, std::min<size_t>(8, n - i));
  }
  std::memcpy(dst.data(), src.data(), n);
  const std::string want = wsync::HexDigest(DigestAlgorithm::kXxh3_128, src);
  std::string got;
  const double copy = BestSeconds(reps, [&] { std::memcpy(dst.data(), src.data(), n); });
  const double hash = BestSeconds(reps, [&] { got = wsync::HexDigest(DigestAlgorithm::kXxh3_128, dst); });
  const double separate = BestSeconds(reps, [&] {
    std::memcpy(dst.data(), src.data(), n);
    got = wsync::HexDigest(DigestAlgorithm::kXxh3_128, dst);
  });
  bool ok = got == want;
  auto fused = [&](bool destination) {
    return BestSeconds(reps, [&] {
      auto h = wsync::Hasher::Create(DigestAlgorithm::kXxh3_128);
      wsync::CopyAndHash(dst.data(), src, *h, destination);
      got = h->FinishHex();
      ok = ok && got == want;
    });
  };
  const double fused_src = fused(false), fused_dst = fused(true);
  auto row = [&](const char* what, double s) {
    std::printf("%-40s %8.3f s %7.2f GB/s  %+6.1f%% of the copy\n", what, s, n / s / 1e9, 100 * (s / copy - 1));
  };
  std::printf("%zu MiB, best of %d, thread CPU time; block %zu KiB; digests %s\n", mib, reps,
              wsync::kCopyHashBlockBytes >> 10, ok ? "agree" : "DIFFER");
  row("memcpy", copy);
  row("xxh3-128 alone", hash);
  row("memcpy, then xxh3-128 (a second pass)", separate);
  row("CopyAndHash, hashing what it read", fused_src);
  row("CopyAndHash, hashing what it wrote", fused_dst);
  return ok ? 0 : 1;
}
