// Micro-benchmark of DeltaCodec on one thread, with realistic data: a bf16 tensor of
// synthetic N(0, 0.02) weights before and after one SyntheticTrainer step (a few percent
// of values change). Prints the patch's shape, GB/s of tensor bytes for Encode (wsync's
// frame writer, and the baseline LibzstdEncoder: libzstd from the same sequences), Apply
// (SparseApplier; libzstd; the baseline's frame; a stock zstd -1 frame as SkyRL writes
// it) and the pieces they fuse (memcpy, xxh3-128, one-shot stock zstd -1 of the patch),
// and the compressed ratios. Times are this thread's CPU time (best of 3; best of 20 in
// the one-loop modes), i.e. per-core cost. `compare` times the two encoders alternately,
// REPS times each, and prints every run and the medians.
//
//   delta_codec_benchmark [MiB=256] [block KiB=64] [encode|apply: only that, 20 times, for perf]
//   delta_codec_benchmark [MiB=256] [block KiB=64] compare [REPS=9]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <zstd.h>

#include "backends/delta/codec.h"
#include "backends/delta/libzstd_baseline.h"
#include "backends/delta/apply/sparse_apply.h"
#include "core/digest.h"
#include "core/stopwatch.h"
#include "synthetic/synthetic.h"

namespace {

// Best of `reps` runs of `f`, in this thread's CPU seconds (what one core spends,
// whatever else shares the machine); `prepare` runs untimed before each.
template <typename P, typename F>
double BestSeconds(int reps, P&& prepare, F&& f) {
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    prepare();
    double t = wsync::ThreadCpuSeconds();
    f();
    best = std::min(best, wsync::ThreadCpuSeconds() - t);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace wsync;
  size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 256;
  size_t block_kib = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 64;
  int64_t elements = static_cast<int64_t>(mib << 20) / 2;
  auto trainer = SyntheticTrainer::FromMetadata({TensorMeta{"w", DType::kBF16, {elements}}}, 7, 2);
  if (!trainer.ok()) return 1;
  HostTensor& t = (*trainer)->tensors()[0];
  size_t n = t.meta.nbytes();
  std::vector<std::byte> old(t.storage.data(), t.storage.data() + n);
  auto step = (*trainer)->Step(1);
  std::span<const std::byte> next(t.storage.data(), n);
  auto codec = delta::DeltaCodec::Create(block_kib << 10);
  if (!codec.ok()) return 1;
  std::vector<std::byte> snap(n), region(n), patch(n);
  auto gbps = [n](double s) { return n / s / 1e9; };
  std::string only = argc > 3 ? argv[3] : "";
  if (only == "compare") {  // the two encoders, interleaved, on the same tensor
    int reps = argc > 4 ? std::atoi(argv[4]) : 9;
    auto lib = delta::LibzstdEncoder::Create(1, block_kib << 10);
    if (!lib.ok()) return 1;
    std::vector<double> td, tl;
    size_t bd = 0, bl = 0;
    for (int r = 0; r < reps; ++r) {
      for (int which = 0; which < 2; ++which) {
        std::memcpy(snap.data(), old.data(), n);
        double t = wsync::ThreadCpuSeconds();
        auto e = which == 0 ? (*codec)->Encode(next, snap, DigestAlgorithm::kXxh3_128)
                            : (*lib)->Encode(next, snap, DigestAlgorithm::kXxh3_128);
        double s = wsync::ThreadCpuSeconds() - t;
        (which == 0 ? td : tl).push_back(s);
        (which == 0 ? bd : bl) = e->compressed.size();
        std::printf("rep %d %-8s %.2f GB/s\n", r, which == 0 ? "direct" : "libzstd", gbps(s));
      }
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::printf("median Encode: direct %.2f GB/s, libzstd %.2f GB/s; frame %.2f%% vs %.2f%%\n",
                gbps(median(td)), gbps(median(tl)), 100.0 * bd / n, 100.0 * bl / n);
    return 0;
  }
  if (!only.empty()) {  // one loop alone, for a profiler
    delta::EncodedDelta e;
    std::memcpy(snap.data(), old.data(), n);
    e = *(*codec)->Encode(next, snap, DigestAlgorithm::kXxh3_128);
    double s = BestSeconds(20, [&] { std::memcpy(snap.data(), old.data(), n); std::memcpy(region.data(), old.data(), n); },
                           [&] {
                             if (only == "encode") {
                               e = *(*codec)->Encode(next, snap, DigestAlgorithm::kXxh3_128);
                             } else {
                               (void)(*codec)->Apply(e.compressed, region, DigestAlgorithm::kXxh3_128, e.checksum, "w");
                             }
                           });
    std::printf("%s %.2f GB/s\n", only.c_str(), gbps(s));
    return 0;
  }

  auto nothing = [] {};
  double memcpy_s = BestSeconds(3, nothing, [&] { std::memcpy(snap.data(), old.data(), n); });
  double hash_s = BestSeconds(3, nothing, [&] { (void)HexDigest(DigestAlgorithm::kXxh3_128, next); });
  delta::EncodedDelta enc;
  double encode_s = BestSeconds(
      3, [&] { std::memcpy(snap.data(), old.data(), n); },
      [&] { enc = *(*codec)->Encode(next, snap, DigestAlgorithm::kXxh3_128); });
  auto viazstd = delta::LibzstdEncoder::Create(1, block_kib << 10);
  if (!viazstd.ok()) return 1;
  delta::EncodedDelta enc_zstd;
  double encode_zstd_s = BestSeconds(
      3, [&] { std::memcpy(snap.data(), old.data(), n); },
      [&] { enc_zstd = *(*viazstd)->Encode(next, snap, DigestAlgorithm::kXxh3_128); });
  for (size_t i = 0; i < n; ++i) patch[i] = old[i] ^ next[i];
  {  // the patch's shape: changed bytes, and the sequences and literals a frame holds
    size_t seqs = 0, lits = 0, nonzero = 0, zeros = 0;
    for (size_t i = 0; i < n; ++i) {
      if (patch[i] == std::byte{0}) {
        ++zeros;
        continue;
      }
      ++nonzero;
      seqs += zeros >= 4;
      lits += (zeros >= 4 ? 1 : zeros) + 1;
      zeros = 0;
    }
    std::printf("patch: %.2f%% nonzero bytes, %zu sequences (%.1f per KiB), %.2f%% literals\n", 100.0 * nonzero / n,
                seqs, seqs * 1024.0 / n, 100.0 * lits / n);
  }
  std::vector<char> out(ZSTD_compressBound(n));
  size_t oneshot = 0;
  double zstd_s = BestSeconds(3, nothing, [&] { oneshot = ZSTD_compress(out.data(), out.size(), patch.data(), n, 1); });
  double apply_s = BestSeconds(
      3, [&] { std::memcpy(region.data(), old.data(), n); },
      [&] { (void)(*codec)->Apply(enc.compressed, region, DigestAlgorithm::kXxh3_128, enc.checksum, "w"); });
  delta::SparseApplier sparse;
  double sparse_s = BestSeconds(
      3, [&] { std::memcpy(region.data(), old.data(), n); }, [&] { (void)sparse.Apply(enc.compressed, region); });
  auto plain = delta::DeltaCodec::Create(block_kib << 10, /*sparse_apply=*/false);
  double plain_s = BestSeconds(
      3, [&] { std::memcpy(region.data(), old.data(), n); },
      [&] { (void)(*plain)->Apply(enc.compressed, region, DigestAlgorithm::kXxh3_128, enc.checksum, "w"); });
  std::vector<uint8_t> stock(out.begin(), out.begin() + oneshot);
  double stock_s = BestSeconds(
      3, [&] { std::memcpy(region.data(), old.data(), n); },
      [&] { (void)(*plain)->Apply(stock, region, DigestAlgorithm::kXxh3_128, enc.checksum, "w"); });
  auto other = delta::DeltaCodec::Create(block_kib << 10);  // sparse first, as the receiver
  double other_s = BestSeconds(
      3, [&] { std::memcpy(region.data(), old.data(), n); },
      [&] { (void)(*other)->Apply(enc_zstd.compressed, region, DigestAlgorithm::kXxh3_128, enc.checksum, "w"); });
  std::vector<uint8_t> decoded(n);
  double libzstd_s = BestSeconds(3, nothing, [&] {
    (void)ZSTD_decompress(decoded.data(), n, enc.compressed.data(), enc.compressed.size());
  });
  std::printf("tensor %zu MiB bf16, %.2f%% of elements changed, block %zu KiB\n", mib,
              100 * step->changed_fraction, block_kib);
  std::printf("compressed %.2f%% of tensor bytes (via libzstd %.2f%%, stock zstd -1: %.2f%%)\n",
              100.0 * enc.compressed.size() / n, 100.0 * enc_zstd.compressed.size() / n, 100.0 * oneshot / n);
  std::printf("%-28s %8.2f GB/s\n", "memcpy", gbps(memcpy_s));
  std::printf("%-28s %8.2f GB/s\n", "xxh3-128", gbps(hash_s));
  std::printf("%-28s %8.2f GB/s\n", "stock zstd -1 (patch)", gbps(zstd_s));
  std::printf("%-28s %8.2f GB/s\n", "Encode via libzstd", gbps(encode_zstd_s));
  std::printf("%-28s %8.2f GB/s\n", "Encode (fused)", gbps(encode_s));
  std::printf("%-28s %8.2f GB/s\n", "libzstd decode of the frame", gbps(libzstd_s));
  std::printf("%-28s %8.2f GB/s\n", "sparse XOR of the frame", gbps(sparse_s));
  std::printf("%-28s %8.2f GB/s\n", "Apply via libzstd, verified", gbps(plain_s));
  std::printf("%-28s %8.2f GB/s\n", "Apply stock -1 frame (libzstd)", gbps(stock_s));
  std::printf("%-28s %8.2f GB/s   (%llu sparse, %llu libzstd frames)\n", "Apply libzstd-encoded frame",
              gbps(other_s), static_cast<unsigned long long>((*other)->sparse_frames()),
              static_cast<unsigned long long>((*other)->libzstd_frames()));
  std::printf("%-28s %8.2f GB/s   (%llu sparse, %llu libzstd frames)\n", "Apply (verified)", gbps(apply_s),
              static_cast<unsigned long long>((*codec)->sparse_frames()),
              static_cast<unsigned long long>((*codec)->libzstd_frames()));
  return 0;
}
