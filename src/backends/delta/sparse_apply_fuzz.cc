// Fuzz target, differential: one zstd frame through libzstd, through SparseApplier and
// through DeltaCodec::Apply (sparse first, libzstd's streaming decoder as its fallback).
// libzstd is the reference, in both of its ways of decoding: one-shot
// (ZSTD_decompressDCtx into a bounded buffer) and streaming into 64 KiB of output room
// at a time (what DeltaCodec does). The two disagree on some frames the format forbids
// (one-shot takes a raw block over 128 KiB, streaming refuses it), so "libzstd accepts"
// means both do, with the same bytes. Then:
//   - SparseApplier may decline a frame libzstd accepts (it then leaves the region as it
//     was), but whatever it accepts, libzstd accepts with the same bytes;
//   - DeltaCodec::Apply accepts exactly what libzstd accepts, with the same bytes (so
//     also refuses a window over the streaming decoder's default limit, 2^27 bytes).
// Every difference aborts. The region is at most 1 MiB: the frame's content size when
// it has one, else what libzstd decoded (4 KiB when it decoded nothing).
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "backends/delta/codec.h"
#include "backends/delta/sparse_apply.h"

namespace {

constexpr size_t kMaxRegion = size_t{1} << 20;

void Fail(const char* what, size_t frame_size, size_t region) {
  std::fprintf(stderr, "sparse_apply_fuzz: %s (frame %zu bytes, region %zu bytes)\n", what, frame_size, region);
  std::abort();
}

// A fixed pattern the patch is XORed into (decoding must never read the region).
std::byte Pattern(size_t i) { return std::byte(static_cast<uint8_t>((i * 0x9E3779B1u) >> 13)); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ZSTD_DCtx* dctx = ZSTD_createDCtx();
  static ZSTD_DCtx* sdctx = ZSTD_createDCtx();
  static wsync::delta::SparseApplier sparse;
  static std::unique_ptr<wsync::delta::DeltaCodec> codec = std::move(*wsync::delta::DeltaCodec::Create());
  static std::vector<uint8_t> ref(kMaxRegion);

  static std::vector<uint8_t> streamed(kMaxRegion);
  unsigned long long content = ZSTD_getFrameContentSize(data, size);
  if (content != ZSTD_CONTENTSIZE_UNKNOWN && content != ZSTD_CONTENTSIZE_ERROR && content > kMaxRegion) return 0;
  size_t cap = content <= kMaxRegion ? static_cast<size_t>(content) : kMaxRegion;
  // One-shot: exactly one frame, no trailing bytes, decoded whole.
  size_t got = ZSTD_decompressDCtx(dctx, ref.data(), cap, data, size);
  bool oneshot_ok = !ZSTD_isError(got) && ZSTD_findFrameCompressedSize(data, size) == size;
  // Streaming, 64 KiB of output room at a time, until the frame ends.
  size_t streamed_bytes = 0;
  bool stream_ok = false;
  {
    ZSTD_DCtx_reset(sdctx, ZSTD_reset_session_and_parameters);
    ZSTD_inBuffer in{data, size, 0};
    uint8_t piece[64 << 10];
    for (;;) {
      ZSTD_outBuffer o{piece, sizeof(piece), 0};
      size_t before = in.pos;
      size_t r = ZSTD_decompressStream(sdctx, &o, &in);
      if (ZSTD_isError(r) || o.pos > kMaxRegion - streamed_bytes) break;
      std::memcpy(streamed.data() + streamed_bytes, piece, o.pos);
      streamed_bytes += o.pos;
      if (r == 0) {
        stream_ok = in.pos == in.size;
        break;
      }
      if (in.pos == before && o.pos == 0) break;  // needs input there is none of
    }
  }
  size_t region_size = content <= kMaxRegion ? static_cast<size_t>(content)
                       : oneshot_ok          ? got
                       : stream_ok           ? streamed_bytes
                                             : 4096;
  if (oneshot_ok && got != region_size) oneshot_ok = false;
  if (stream_ok && streamed_bytes != region_size) stream_ok = false;
  if (oneshot_ok && stream_ok && std::memcmp(ref.data(), streamed.data(), region_size) != 0) {
    Fail("libzstd's one-shot and streaming decoders give different bytes", size, region_size);
  }
  bool zstd_ok = oneshot_ok && stream_ok;

  std::vector<std::byte> region(region_size);
  for (size_t i = 0; i < region_size; ++i) region[i] = Pattern(i);
  bool sparse_ok = sparse.Apply(std::span<const uint8_t>(data, size), region);
  for (size_t i = 0; i < region_size; ++i) {
    std::byte want = sparse_ok ? Pattern(i) ^ std::byte(ref[i]) : Pattern(i);
    if (sparse_ok && !zstd_ok) Fail("sparse accepted a frame libzstd rejects", size, region_size);
    if (region[i] != want) {
      Fail(sparse_ok ? "sparse bytes differ from libzstd's" : "sparse declined but wrote", size, region_size);
    }
  }
  if (sparse_ok && !zstd_ok) Fail("sparse accepted a frame libzstd rejects", size, region_size);

  for (size_t i = 0; i < region_size; ++i) region[i] = Pattern(i);
  wsync::Status s = codec->Apply(std::span<const uint8_t>(data, size), region, wsync::DigestAlgorithm::kXxh3_128, "",
                                 "fuzz");
  if (s.ok() && !zstd_ok) {
    Fail(stream_ok ? "DeltaCodec accepted a frame libzstd's one-shot decoder rejects"
                   : "DeltaCodec accepted a frame libzstd rejects", size, region_size);
  }
  if (!s.ok() && zstd_ok) Fail("DeltaCodec rejected a frame libzstd accepts", size, region_size);
  if (s.ok()) {
    for (size_t i = 0; i < region_size; ++i) {
      if (region[i] != (Pattern(i) ^ std::byte(ref[i]))) {
        Fail("DeltaCodec bytes differ from libzstd's", size, region_size);
      }
    }
  }
  return 0;
}
