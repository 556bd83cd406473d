#include "backends/delta/codec.h"

// The block-level sequence producer API (stable since zstd 1.5.4, still declared in the
// "static linking only" section; the shared library exports it).
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

// patch = next ^ snap and snap = next over n bytes; returns the nonzero bytes of patch.
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

// zstd's sequence producer for XOR patches. A patch is runs of zeros between isolated
// changed bytes, which zstd's own fast match finder handles badly (short hash hits,
// many misses; docs/benchmarks.md, "delta", times stock zstd -1 on such a patch). Here
// every zero run of four or more bytes becomes one literal zero followed by a match at
// offset 1 (copy the previous byte), which zstd encodes as repeat-offset 1 with no
// offset bits; everything else stays literal, and zstd's level-1 entropy stage codes
// both. One pass, no hashing; the frame
// is a standard one any decoder reads. Offsets never leave the block (zstd passes no
// history to producers).
size_t ProduceSparseSequences(void*, ZSTD_Sequence* out, size_t capacity, const void* src, size_t n,
                              const void*, size_t, int, size_t) {
  const uint8_t* p = static_cast<const uint8_t*>(src);
  size_t zero_start = 0;     // first byte after the last changed byte seen
  size_t literals_from = 0;  // first byte not yet covered by a sequence
  size_t count = 0;
  // Closes the zero run [zero_start, end): a literal zero, then the rest as a match.
  auto run_ends = [&](size_t end) -> bool {
    size_t run = end - zero_start;
    if (run < 4) return true;  // too short for literal zero + a 3-byte match: stays literal
    if (count + 2 > capacity) return false;
    out[count++] = ZSTD_Sequence{1, static_cast<unsigned>(zero_start + 1 - literals_from),
                                 static_cast<unsigned>(run - 1), 0};
    literals_from = end;
    return true;
  };
  for (size_t base = 0; base < n; base += 64) {
    uint64_t mask = NonzeroMask(p + base, std::min<size_t>(64, n - base));
    while (mask != 0) {  // one iteration per changed byte
      size_t pos = base + static_cast<size_t>(std::countr_zero(mask));
      mask &= mask - 1;
      if (!run_ends(pos)) return ZSTD_SEQUENCE_PRODUCER_ERROR;
      zero_start = pos + 1;
    }
  }
  if (!run_ends(n) || count + 1 > capacity) return ZSTD_SEQUENCE_PRODUCER_ERROR;
  out[count++] = ZSTD_Sequence{0, static_cast<unsigned>(n - literals_from), 0, 0};  // last literals
  return count;
}

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

// A page of zeros for the leading unchanged blocks of a frame.
const std::byte* ZeroBlock(size_t n) {
  static const std::vector<std::byte> zeros(kMaxBlockBytes);
  return n <= zeros.size() ? zeros.data() : nullptr;
}

}  // namespace

struct DeltaCodec::Zstd {
  ZSTD_CCtx* cctx = nullptr;
  ZSTD_DCtx* dctx = nullptr;
  ~Zstd() {
    ZSTD_freeCCtx(cctx);
    ZSTD_freeDCtx(dctx);
  }
};

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

Result<std::unique_ptr<DeltaCodec>> DeltaCodec::Create(int zstd_level, size_t block_bytes, bool sparse_apply,
                                                      Encoder encoder) {
  if (block_bytes == 0 || block_bytes > kMaxBlockBytes) {
    return InvalidArgument(fmt::format("delta block size {} must be in (0, {}]", block_bytes, kMaxBlockBytes));
  }
  std::unique_ptr<DeltaCodec> c(new DeltaCodec());
  c->zstd_ = std::make_unique<Zstd>();
  c->zstd_->cctx = ZSTD_createCCtx();
  c->zstd_->dctx = ZSTD_createDCtx();
  if (c->zstd_->cctx == nullptr || c->zstd_->dctx == nullptr) return Internal("zstd: out of memory for contexts");
  WSYNC_ZSTD_CHECK(ZSTD_CCtx_setParameter(c->zstd_->cctx, ZSTD_c_compressionLevel, zstd_level),
                   StatusCode::kInvalidArgument, fmt::format("zstd level {}", zstd_level));
  ZSTD_registerSequenceProducer(c->zstd_->cctx, nullptr, ProduceSparseSequences);
  if (sparse_apply) c->sparse_ = std::make_unique<SparseApplier>();
  if (encoder == Encoder::kDirect) c->writer_ = std::make_unique<zstd::FrameWriter>();
  c->level_ = zstd_level;
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
  ZSTD_CCtx* cctx = zstd_->cctx;
  size_t used = 0;
  // Feeds `in` to the frame; `end` closes it.
  auto feed = [&](const std::byte* p, size_t n, bool end) -> Status {
    ZSTD_inBuffer in{p, n, 0};
    for (;;) {
      if (out.compressed.size() - used < ZSTD_CStreamOutSize()) {
        out.compressed.resize(std::max(out.compressed.size() * 2, used + 2 * ZSTD_CStreamOutSize()));
      }
      ZSTD_outBuffer o{out.compressed.data() + used, out.compressed.size() - used, 0};
      size_t left = ZSTD_compressStream2(cctx, &o, &in, end ? ZSTD_e_end : ZSTD_e_continue);
      WSYNC_ZSTD_CHECK(left, StatusCode::kInternal, "zstd compression");
      used += o.pos;
      if (end ? left == 0 : in.pos == in.size) return Status::Ok();
    }
  };
  if (writer_ != nullptr) return EncodeDirect(next, snapshot, algorithm, options);
  auto previous = options.hash_previous ? Hasher::Create(algorithm) : nullptr;
  size_t leading_zeros = 0;  // unchanged bytes before the first change, not yet fed
  for (size_t off = 0; off < next.size(); off += block_bytes_) {
    size_t n = std::min(block_bytes_, next.size() - off);
    hasher->Update(next.subspan(off, n));
    if (previous) previous->Update(snapshot.subspan(off, n));
    uint64_t nz = XorUpdate(next.data() + off, snapshot.data() + off, block_.data(), n);
    if (options.after_block) options.after_block(off + n);
    if (!out.changed) {
      if (nz == 0) {
        leading_zeros += n;
        continue;
      }
      out.changed = true;
      // Room for a typical frame (a few % of the tensor) up front: growing by doubling
      // would fault in and copy the output several times.
      out.compressed.resize(next.size() / 16 + 2 * ZSTD_CStreamOutSize());
      WSYNC_ZSTD_CHECK(ZSTD_CCtx_reset(cctx, ZSTD_reset_session_only), StatusCode::kInternal, "zstd reset");
      WSYNC_ZSTD_CHECK(ZSTD_CCtx_setPledgedSrcSize(cctx, next.size()), StatusCode::kInternal, "zstd size");
      for (size_t z = 0; z < leading_zeros; z += block_bytes_) {
        WSYNC_RETURN_IF_ERROR(feed(ZeroBlock(block_bytes_), std::min(block_bytes_, leading_zeros - z), false));
      }
    }
    out.changed_bytes += nz;
    WSYNC_RETURN_IF_ERROR(feed(block_.data(), n, false));
  }
  if (out.changed) WSYNC_RETURN_IF_ERROR(feed(nullptr, 0, true));
  out.compressed.resize(used);
  if (out.compressed.capacity() > 2 * used + (size_t{1} << 16)) out.compressed.shrink_to_fit();
  out.checksum = hasher->FinishHex();
  if (previous) out.previous_checksum = previous->FinishHex();
  return out;
}

Result<EncodedDelta> DeltaCodec::EncodeDirect(std::span<const std::byte> next, std::span<std::byte> snapshot,
                                              DigestAlgorithm algorithm, const EncodeOptions& options) {
  EncodedDelta out;
  auto hasher = Hasher::Create(algorithm);
  auto previous = options.hash_previous ? Hasher::Create(algorithm) : nullptr;
  size_t used = WriteBlocks(*writer_, next, snapshot, hasher.get(), previous.get(), /*part=*/false,
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
  // libzstd writes whole frames only: with Encoder::kLibzstd, parts come from a FrameWriter too.
  if (writer_ == nullptr && part_writer_ == nullptr) part_writer_ = std::make_unique<zstd::FrameWriter>();
  zstd::FrameWriter& writer = writer_ != nullptr ? *writer_ : *part_writer_;
  auto hasher = digests ? Hasher::Create(DigestAlgorithm::kXxh3_128) : nullptr;
  auto previous = digests ? Hasher::Create(DigestAlgorithm::kXxh3_128) : nullptr;
  size_t used = WriteBlocks(writer, next, snapshot, hasher.get(), previous.get(), /*part=*/true, last,
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
