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
//
// An input that starts with 0xB5 is a recipe rather than a frame (BuildFrame): a frame
// header and a list of blocks of chosen types and sizes, so that block and window limits
// are reached far more often than by mutating a frame's bytes.
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "backends/delta/codec.h"
#include "backends/delta/apply/sparse_apply.h"

namespace {

constexpr size_t kMaxRegion = size_t{1} << 20;

void Fail(const char* what, size_t frame_size, size_t region) {
  std::fprintf(stderr, "sparse_apply_fuzz: %s (frame %zu bytes, region %zu bytes)\n", what, frame_size, region);
  std::abort();
}

// A fixed pattern the patch is XORed into (decoding must never read the region).
std::byte Pattern(size_t i) { return std::byte(static_cast<uint8_t>((i * 0x9E3779B1u) >> 13)); }

// The recipe after the 0xB5: Frame_Header_Descriptor, Window_Descriptor, then blocks of
// [control: type (bits 0-1), last (bit 2), size from the next 3 bytes (bit 3), or
// else from the control's top 4 bits times 9000] [contents: a raw block's bytes (the
// recipe's, repeated to the size), an RLE block's byte, a compressed block's bytes],
// then 4 checksum bytes when the descriptor asks for them. The content size field holds
// the sum of raw and RLE sizes unless the descriptor's single-segment flag is clear and
// bit 4 (unused by the format) is set: then the recipe's bytes right after the window.
std::vector<uint8_t> BuildFrame(const uint8_t* p, size_t n) {
  std::vector<uint8_t> f = {0x28, 0xB5, 0x2F, 0xFD};
  if (n < 2) return f;
  const uint8_t fhd = p[0], wd = p[1];
  size_t at = 2;
  auto next = [&]() -> uint8_t { return at < n ? p[at++] : 0; };
  std::vector<uint8_t> blocks;
  uint64_t content = 0;
  const size_t fcs_bytes_early = (fhd & 0x10) && !(fhd & 0x20) ? size_t{1} << (fhd >> 6) : 0;
  std::vector<uint8_t> raw_fcs;
  for (size_t i = 0; i < fcs_bytes_early; ++i) raw_fcs.push_back(next());
  for (int b = 0; b < 16 && at < n; ++b) {
    uint8_t ctl = next();
    unsigned type = ctl & 3;
    bool last = (ctl & 4) != 0;
    uint32_t bsize = (ctl & 8) ? (uint32_t{next()} | uint32_t{next()} << 8 | uint32_t{next()} << 16) & 0x1FFFFF
                               : static_cast<uint32_t>(ctl >> 4) * 9000;
    uint32_t header = (bsize << 3) | (type << 1) | (last ? 1 : 0);
    blocks.push_back(static_cast<uint8_t>(header));
    blocks.push_back(static_cast<uint8_t>(header >> 8));
    blocks.push_back(static_cast<uint8_t>(header >> 16));
    if (type == 0) {
      size_t from = at;
      for (uint32_t k = 0; k < bsize; ++k) blocks.push_back(from < n ? p[from + k % (n - from)] : 0);
      at = std::min(n, at + bsize);
      content += bsize;
    } else if (type == 1) {
      blocks.push_back(next());
      content += bsize;
    } else {
      for (uint32_t k = 0; k < bsize && at < n; ++k) blocks.push_back(next());
    }
    if (content > kMaxRegion || last) break;
  }
  f.push_back(fhd);
  if (!(fhd & 0x20)) f.push_back(wd);
  const unsigned dict_bytes = (fhd & 3) == 0 ? 0u : 1u << ((fhd & 3) - 1);
  for (unsigned i = 0; i < dict_bytes; ++i) f.push_back(i == 0 ? 1 : 0);  // Dictionary_ID 1
  size_t fcs_bytes = (fhd >> 6) == 0 ? ((fhd & 0x20) ? 1 : 0) : size_t{1} << (fhd >> 6);
  if (!raw_fcs.empty()) {
    f.insert(f.end(), raw_fcs.begin(), raw_fcs.end());
  } else {
    uint64_t v = fcs_bytes == 2 ? content - 256 : content;
    for (size_t i = 0; i < fcs_bytes; ++i) f.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  f.insert(f.end(), blocks.begin(), blocks.end());
  if (fhd & 0x04) {
    for (int i = 0; i < 4; ++i) f.push_back(next());  // a content checksum (rarely the right one)
  }
  return f;
}

int CheckFrame(const uint8_t* data, size_t size);

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 0 && data[0] == 0xB5) {
    std::vector<uint8_t> frame = BuildFrame(data + 1, size - 1);
    return CheckFrame(frame.data(), frame.size());
  }
  return CheckFrame(data, size);
}

namespace {

int CheckFrame(const uint8_t* data, size_t size) {
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

}  // namespace
