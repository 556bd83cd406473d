#include "backends/delta/libzstd_baseline.h"

// The block-level sequence producer API (stable since zstd 1.5.4, still declared in the
// "static linking only" section; the shared library exports it).
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>

#include <algorithm>
#include <bit>

#include <fmt/format.h>

#include "backends/delta/nonzero_mask.h"

namespace wsync::delta {
namespace {

// A zstd return code that is an error becomes an Internal status naming the call.
#define WSYNC_ZSTD_BASELINE_CHECK(expr, what)                                                                   \
  do {                                                                                                          \
    size_t wsync_zr_ = (expr);                                                                                  \
    if (ZSTD_isError(wsync_zr_)) return Internal(fmt::format("{}: {}", (what), ZSTD_getErrorName(wsync_zr_))); \
  } while (0)

// zstd's sequence producer for XOR patches: every zero run of four or more bytes becomes
// one literal zero followed by a match at offset 1 (copy the previous byte), which zstd
// encodes as repeat-offset 1 with no offset bits; everything else stays literal, and
// zstd's entropy stage codes both. One pass, no hashing. Offsets never leave the block
// (zstd passes no history to producers).
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

// A page of zeros for the leading unchanged blocks of a frame.
const std::byte* ZeroBlock() {
  static const std::vector<std::byte> zeros(kMaxBlockBytes);
  return zeros.data();
}

}  // namespace

struct LibzstdEncoder::Ctx {
  ZSTD_CCtx* cctx = nullptr;
  ~Ctx() { ZSTD_freeCCtx(cctx); }
};

Result<std::unique_ptr<LibzstdEncoder>> LibzstdEncoder::Create(int level, size_t block_bytes) {
  if (block_bytes == 0 || block_bytes > kMaxBlockBytes) {
    return InvalidArgument(fmt::format("delta block size {} must be in (0, {}]", block_bytes, kMaxBlockBytes));
  }
  std::unique_ptr<LibzstdEncoder> e(new LibzstdEncoder());
  e->ctx_ = std::make_unique<Ctx>();
  e->ctx_->cctx = ZSTD_createCCtx();
  if (e->ctx_->cctx == nullptr) return Internal("zstd: out of memory for a compression context");
  WSYNC_ZSTD_BASELINE_CHECK(ZSTD_CCtx_setParameter(e->ctx_->cctx, ZSTD_c_compressionLevel, level),
                            fmt::format("zstd level {}", level));
  ZSTD_registerSequenceProducer(e->ctx_->cctx, nullptr, ProduceSparseSequences);
  e->block_bytes_ = block_bytes;
  e->block_.resize(block_bytes);
  return e;
}

LibzstdEncoder::~LibzstdEncoder() = default;

Result<EncodedDelta> LibzstdEncoder::Encode(std::span<const std::byte> next, std::span<std::byte> snapshot,
                                            DigestAlgorithm algorithm) {
  if (next.size() != snapshot.size()) {
    return InvalidArgument(fmt::format("new bytes ({}) and snapshot ({}) differ in size", next.size(),
                                       snapshot.size()));
  }
  EncodedDelta out;
  auto hasher = Hasher::Create(algorithm);
  ZSTD_CCtx* cctx = ctx_->cctx;
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
      WSYNC_ZSTD_BASELINE_CHECK(left, "zstd compression");
      used += o.pos;
      if (end ? left == 0 : in.pos == in.size) return Status::Ok();
    }
  };
  size_t leading_zeros = 0;  // unchanged bytes before the first change, not yet fed
  for (size_t off = 0; off < next.size(); off += block_bytes_) {
    size_t n = std::min(block_bytes_, next.size() - off);
    hasher->Update(next.subspan(off, n));
    uint64_t nz = XorUpdate(next.data() + off, snapshot.data() + off, block_.data(), n);
    if (!out.changed) {
      if (nz == 0) {
        leading_zeros += n;
        continue;
      }
      out.changed = true;
      // Room for a typical frame (a few % of the tensor) up front: growing by doubling
      // would fault in and copy the output several times.
      out.compressed.resize(next.size() / 16 + 2 * ZSTD_CStreamOutSize());
      WSYNC_ZSTD_BASELINE_CHECK(ZSTD_CCtx_reset(cctx, ZSTD_reset_session_only), "zstd reset");
      WSYNC_ZSTD_BASELINE_CHECK(ZSTD_CCtx_setPledgedSrcSize(cctx, next.size()), "zstd size");
      for (size_t z = 0; z < leading_zeros; z += block_bytes_) {
        WSYNC_RETURN_IF_ERROR(feed(ZeroBlock(), std::min(block_bytes_, leading_zeros - z), false));
      }
    }
    out.changed_bytes += nz;
    WSYNC_RETURN_IF_ERROR(feed(block_.data(), n, false));
  }
  if (out.changed) WSYNC_RETURN_IF_ERROR(feed(nullptr, 0, true));
  out.compressed.resize(used);
  if (out.compressed.capacity() > 2 * used + (size_t{1} << 16)) out.compressed.shrink_to_fit();
  out.checksum = hasher->FinishHex();
  return out;
}

}  // namespace wsync::delta
