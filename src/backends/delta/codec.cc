#include "backends/delta/codec.h"

// ZSTD_frameHeaderSize is declared in the "static linking only" section; the shared
// library exports it.
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <fmt/format.h>

#include "backends/delta/nonzero_mask.h"

namespace wsync::delta {
namespace {

// Checks a zstd return code; on error returns `code` naming the call, the call site and
// zstd's own error name.
#define WSYNC_ZSTD_CHECK(expr, code, what)                                                   \
  do {                                                                                       \
    size_t wsync_zr_ = (expr);                                                               \
    if (ZSTD_isError(wsync_zr_)) {                                                           \
      return ::wsync::Status((code), ::fmt::format("{}: {} ({} at {}:{})", (what),           \
                                                   ZSTD_getErrorName(wsync_zr_), #expr,      \
                                                   __FILE__, __LINE__));                     \
    }                                                                                        \
  } while (0)

constexpr uint64_t kLow7 = 0x7f7f7f7f7f7f7f7fULL;
constexpr uint64_t kHigh = 0x8080808080808080ULL;

#if defined(__x86_64__)
// XorUpdate with AVX2, which also leaves in masks[k] the nonzero bytes of the patch's
// k-th 64-byte chunk (bit i: byte 64k + i), so that the frame writer scans 1/512 of
// the bytes it would otherwise re-read.
__attribute__((target("avx2,popcnt"))) uint64_t XorUpdateAvx2(const std::byte* next, std::byte* snap,
                                                              std::byte* patch, size_t n, uint64_t* masks) {
  const __m256i zero = _mm256_setzero_si256();
  uint64_t nonzero = 0;
  size_t full = n / 64;
  for (size_t c = 0; c < full; ++c) {
    const size_t o = 64 * c;
    __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(next + o));
    __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(next + o + 32));
    __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(snap + o));
    __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(snap + o + 32));
    __m256i x0 = _mm256_xor_si256(a0, b0), x1 = _mm256_xor_si256(a1, b1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(patch + o), x0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(patch + o + 32), x1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(snap + o), a0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(snap + o + 32), a1);
    uint64_t z = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(x0, zero))) |
                 uint64_t{static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(x1, zero)))} << 32;
    masks[c] = ~z;
    nonzero += static_cast<uint64_t>(_mm_popcnt_u64(~z));
  }
  if (size_t o = 64 * full; o < n) {
    uint64_t m = 0;
    for (size_t i = 0; o + i < n; ++i) {
      std::byte x = next[o + i] ^ snap[o + i];
      patch[o + i] = x;
      snap[o + i] = next[o + i];
      m |= uint64_t{x != std::byte{0}} << i;
    }
    masks[full] = m;
    nonzero += static_cast<uint64_t>(std::popcount(m));
  }
  return nonzero;
}
#endif

// What libzstd's streaming decoder lets through and its one-shot decoder (and RFC 8878)
// refuses: a Compressed_Block of 0 bytes, which streaming takes for an empty block. The
// block headers of a zstd frame are walked (not the blocks); a frame too short for its
// headers is left to libzstd, which reports it.
Status CheckBlockHeaders(std::span<const uint8_t> frame, std::string_view what) {
  if (frame.size() < 4 || frame[0] != 0x28 || frame[1] != 0xB5 || frame[2] != 0x2F || frame[3] != 0xFD) {
    return Status::Ok();
  }
  size_t at = ZSTD_frameHeaderSize(frame.data(), frame.size());
  if (ZSTD_isError(at)) return Status::Ok();
  while (at + 3 <= frame.size()) {
    uint32_t h = uint32_t{frame[at]} | uint32_t{frame[at + 1]} << 8 | uint32_t{frame[at + 2]} << 16;
    at += 3;
    unsigned type = (h >> 1) & 3;
    size_t size = h >> 3;
    if (type == 2 && size == 0) {
      return DataLoss(fmt::format("{}: corrupt patch: a compressed block of 0 bytes", what));
    }
    at += type == 1 ? 1 : size;
    if (h & 1) break;
  }
  return Status::Ok();
}

}  // namespace

struct DeltaCodec::Zstd {
  ZSTD_DCtx* dctx = nullptr;
  ~Zstd() { ZSTD_freeDCtx(dctx); }
};

// Word-at-a-time so that GCC vectorizes it; the per-byte "nonzero" flags accumulate in
// byte lanes and are folded every 128 words, before a lane can overflow.
uint64_t XorUpdate(const std::byte* next, std::byte* snap, std::byte* patch, size_t n) {
  uint64_t nonzero = 0;
  size_t words = n / 8;
  for (size_t base = 0; base < words; base += 128) {
    size_t end = std::min(words, base + 128);
    uint64_t lanes = 0;
    for (size_t w = base; w < end; ++w) {
      uint64_t a, b;
      std::memcpy(&a, next + 8 * w, 8);
      std::memcpy(&b, snap + 8 * w, 8);
      uint64_t x = a ^ b;
      std::memcpy(patch + 8 * w, &x, 8);
      std::memcpy(snap + 8 * w, &a, 8);
      lanes += (((x & kLow7) + kLow7) | x) >> 7 & (kHigh >> 7);
    }
    nonzero += (lanes * 0x0101010101010101ULL) >> 56;
  }
  for (size_t i = 8 * words; i < n; ++i) {
    std::byte x = next[i] ^ snap[i];
    patch[i] = x;
    snap[i] = next[i];
    nonzero += x != std::byte{0};
  }
  return nonzero;
}

void XorInto(std::span<std::byte> dst, std::span<const std::byte> src) {
  size_t n = std::min(dst.size(), src.size());
  std::byte* d = dst.data();
  const std::byte* s = src.data();
  size_t words = n / 8;
  for (size_t w = 0; w < words; ++w) {
    uint64_t a, b;
    std::memcpy(&a, d + 8 * w, 8);
    std::memcpy(&b, s + 8 * w, 8);
    a ^= b;
    std::memcpy(d + 8 * w, &a, 8);
  }
  for (size_t i = 8 * words; i < n; ++i) d[i] ^= s[i];
}

Result<std::unique_ptr<DeltaCodec>> DeltaCodec::Create(size_t block_bytes, bool sparse_apply) {
  if (block_bytes == 0 || block_bytes > kMaxBlockBytes) {
    return InvalidArgument(fmt::format("delta block size {} must be in (0, {}]", block_bytes, kMaxBlockBytes));
  }
  std::unique_ptr<DeltaCodec> c(new DeltaCodec());
  c->zstd_ = std::make_unique<Zstd>();
  c->zstd_->dctx = ZSTD_createDCtx();
  if (c->zstd_->dctx == nullptr) return Internal("zstd: out of memory for a decompression context");
  if (sparse_apply) c->sparse_ = std::make_unique<SparseApplier>();
  c->block_bytes_ = block_bytes;
  c->block_.resize(block_bytes + 64);
  c->masks_.resize(block_bytes / 64 + 1);
  return c;
}

DeltaCodec::~DeltaCodec() = default;

Result<EncodedDelta> DeltaCodec::Encode(std::span<const std::byte> next, std::span<std::byte> snapshot,
                                        DigestAlgorithm algorithm, const EncodeOptions& options) {
  if (next.size() != snapshot.size()) {
    return InvalidArgument(fmt::format("new bytes ({}) and snapshot ({}) differ in size", next.size(),
                                       snapshot.size()));
  }
  EncodedDelta out;
  auto hasher = Hasher::Create(algorithm);
  auto previous = options.hash_previous ? Hasher::Create(algorithm) : nullptr;
  size_t used = WriteBlocks(writer_, next, snapshot, hasher.get(), previous.get(), /*part=*/false,
                            /*ends_frame=*/true, &out.changed_bytes,
                            options.after_block ? &options.after_block : nullptr);
  out.changed = out.changed_bytes > 0;
  if (out.changed) out.compressed.assign(frame_.begin(), frame_.begin() + static_cast<std::ptrdiff_t>(used));
  out.checksum = hasher->FinishHex();
  if (previous) out.previous_checksum = previous->FinishHex();
  return out;
}

EncodedPart DeltaCodec::EncodePart(std::span<const std::byte> next, std::span<std::byte> snapshot, bool last,
                                   bool digests) {
  EncodedPart out;
  auto hasher = digests ? Hasher::Create(DigestAlgorithm::kXxh3_128) : nullptr;
  auto previous = digests ? Hasher::Create(DigestAlgorithm::kXxh3_128) : nullptr;
  size_t used = WriteBlocks(writer_, next, snapshot, hasher.get(), previous.get(), /*part=*/true, last,
                            &out.changed_bytes);
  out.blocks.assign(frame_.begin(), frame_.begin() + static_cast<std::ptrdiff_t>(used));
  if (digests) {
    out.checksum = hasher->FinishHex();
    out.previous_checksum = previous->FinishHex();
  }
  return out;
}

std::vector<uint8_t> DeltaCodec::JoinParts(uint64_t content_size, std::span<const EncodedPart> parts) {
  uint64_t changed = 0;
  size_t bytes = zstd::FrameWriter::kMaxFrameHeader;
  for (const EncodedPart& p : parts) {
    changed += p.changed_bytes;
    bytes += p.blocks.size();
  }
  if (changed == 0) return {};
  std::vector<uint8_t> frame(bytes);
  size_t used = zstd::FrameWriter::WriteFrameHeader(content_size, frame.data());
  for (const EncodedPart& p : parts) {
    std::memcpy(frame.data() + used, p.blocks.data(), p.blocks.size());
    used += p.blocks.size();
  }
  frame.resize(used);
  return frame;
}

size_t DeltaCodec::WriteBlocks(zstd::FrameWriter& writer, std::span<const std::byte> next,
                               std::span<std::byte> snapshot, Hasher* hasher, Hasher* previous, bool part,
                               bool ends_frame, uint64_t* changed_bytes,
                               const std::function<void(size_t)>* after_block) {
  size_t used = 0;
  bool begun = false;
  size_t leading_zeros = 0;  // unchanged bytes before the first change, not yet written
  const auto* patch = reinterpret_cast<const uint8_t*>(block_.data());
  uint64_t* masks = nullptr;
#if defined(__x86_64__)
  if (zstd::Avx2Enabled()) masks = masks_.data();
#endif
  if (part) {  // a part is written whole (its unchanged blocks as RLE blocks): JoinParts needs every byte
    writer.BeginPart(&frame_, &used);
    begun = true;
  }
  for (size_t off = 0; off < next.size(); off += block_bytes_) {
    size_t n = std::min(block_bytes_, next.size() - off);
    bool last = ends_frame && off + n == next.size();
    if (hasher != nullptr) hasher->Update(next.subspan(off, n));
    if (previous != nullptr) previous->Update(snapshot.subspan(off, n));
#if defined(__x86_64__)
    uint64_t nz = masks != nullptr ? XorUpdateAvx2(next.data() + off, snapshot.data() + off, block_.data(), n, masks)
                                   : XorUpdate(next.data() + off, snapshot.data() + off, block_.data(), n);
#else
    uint64_t nz = XorUpdate(next.data() + off, snapshot.data() + off, block_.data(), n);
#endif
    if (after_block != nullptr) (*after_block)(off + n);
    if (!begun) {
      if (nz == 0) {
        leading_zeros += n;
        continue;
      }
      begun = true;
      // The frame goes to this codec's own buffer, which stays mapped between tensors,
      // and is copied out once at its final size: a fresh vector per tensor would be
      // zero-filled and faulted in at a guessed size, then shrunk by another copy.
      writer.Begin(next.size(), &frame_, &used);
      if (leading_zeros > 0) writer.AddZeros(leading_zeros, false);
    }
    *changed_bytes += nz;
    if (nz == 0) {
      writer.AddZeros(n, last);
    } else {
      // The next block's source and snapshot lines are fetched while this one is coded.
      size_t ahead = std::min(block_bytes_, next.size() - off - n);
      writer.AddBlock(patch, n, last, masks,
                        Prefetch{next.data() + off + n, ahead, snapshot.data() + off + n, ahead});
    }
  }
  return used;
}

Status DeltaCodec::Apply(std::span<const uint8_t> frame, std::span<std::byte> region,
                         DigestAlgorithm algorithm, std::string_view expected_hex, std::string_view what) {
  unsigned long long content = ZSTD_getFrameContentSize(frame.data(), frame.size());
  if (content == ZSTD_CONTENTSIZE_ERROR) {
    return DataLoss(fmt::format("{}: the patch is not a zstd frame ({} bytes)", what, frame.size()));
  }
  if (content != ZSTD_CONTENTSIZE_UNKNOWN && content != region.size()) {
    return DataLoss(fmt::format("{}: the patch decompresses to {} bytes, the tensor has {}", what,
                                content, region.size()));
  }
  auto hasher = expected_hex.empty() ? nullptr : Hasher::Create(algorithm);
  if (sparse_ && content == region.size() && sparse_->Apply(frame, region, hasher.get())) {
    ++sparse_frames_;
    if (!hasher) return Status::Ok();
    std::string got = hasher->FinishHex();
    if (got != expected_hex) {
      return DataLoss(fmt::format("{}: checksum after apply is {}, the manifest says {}", what, got, expected_hex));
    }
    return Status::Ok();
  }
  ++libzstd_frames_;
  WSYNC_RETURN_IF_ERROR(CheckBlockHeaders(frame, what));
  if (hasher) hasher = Hasher::Create(algorithm);  // the sparse attempt fed it
  ZSTD_DCtx* dctx = zstd_->dctx;
  WSYNC_ZSTD_CHECK(ZSTD_DCtx_reset(dctx, ZSTD_reset_session_only), StatusCode::kInternal, "zstd reset");
  ZSTD_inBuffer in{frame.data(), frame.size(), 0};
  size_t done = 0;
  for (;;) {
    ZSTD_outBuffer o{block_.data(), block_bytes_, 0};
    size_t r = ZSTD_decompressStream(dctx, &o, &in);
    WSYNC_ZSTD_CHECK(r, StatusCode::kDataLoss, fmt::format("{}: corrupt patch", what));
    if (o.pos > 0) {
      if (o.pos > region.size() - done) {
        return DataLoss(fmt::format("{}: the patch decompresses past the tensor's {} bytes", what, region.size()));
      }
      std::span<std::byte> dst = region.subspan(done, o.pos);
      XorInto(dst, std::span<const std::byte>(block_.data(), o.pos));
      if (hasher) hasher->Update(dst);
      done += o.pos;
    }
    if (r == 0) break;  // frame complete
    if (in.pos == in.size && o.pos < o.size) {
      return DataLoss(fmt::format("{}: the patch ends inside its zstd frame ({} bytes)", what, frame.size()));
    }
  }
  if (in.pos != in.size) {
    return DataLoss(fmt::format("{}: {} bytes follow the patch's zstd frame", what, in.size - in.pos));
  }
  if (done != region.size()) {
    return DataLoss(fmt::format("{}: the patch decompresses to {} bytes, the tensor has {}", what, done,
                                region.size()));
  }
  if (!hasher) return Status::Ok();
  std::string got = hasher->FinishHex();
  if (got != expected_hex) {
    return DataLoss(fmt::format("{}: checksum after apply is {}, the manifest says {}", what, got, expected_hex));
  }
  return Status::Ok();
}

}  // namespace wsync::delta
