#include "backends/delta/apply/sparse_apply.h"

#include <algorithm>
#include <bit>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "backends/delta/apply/zstd_decode.h"

// The decoder follows RFC 8878 (doc/zstd_compression_format.md in the zstd sources);
// section names below are the RFC's. Every read is bounds-checked: malformed input ends
// in `false`, never in a read outside the frame.
namespace wsync::delta {
namespace {

using zstd::BackBits;
using zstd::BuildFse;
using zstd::FseEntry;
using zstd::FseTable;
using zstd::kLlBase;
using zstd::kLlBits;
using zstd::kLlDefault;
using zstd::kMlBase;
using zstd::kMlBits;
using zstd::kMlDefault;
using zstd::kOfDefault;
using zstd::Le;
using zstd::ReadFse;

constexpr size_t kBlockMax = 128 * 1024;
// libzstd's streaming decoder's default largest window (ZSTD_WINDOWLOG_LIMIT_DEFAULT).
constexpr uint64_t kMaxWindow = uint64_t{1} << 27;
// How far ahead of its write position the sequence loop prefetches the tensor. The
// hardware prefetcher stops at each 4 KiB page of the mapped file; one line a short
// distance ahead per sequence (an RL-step patch has a sequence every few dozen bytes)
// keeps the next page coming, where prefetching a whole block ahead does not
// (docs/benchmarks.md, "delta", has the micro-benchmark).
constexpr size_t kRegionPrefetchAhead = 2048;

// Where the patch is being applied: the tensor, the write position, and how many bytes
// of patch just before that position are zeros (a match reading only those bytes copies
// zeros, so it changes nothing).
struct Output {
  std::byte* region;
  size_t size;
  size_t pos = 0;
  size_t tz = 0;
};

// XORs n literals into the output and advances it.
__attribute__((always_inline)) inline void PutLiterals(Output& out, const uint8_t* lit, size_t n) {
  size_t last_nonzero = n;
  std::byte* dst = out.region + out.pos;
  for (size_t i = 0; i < n; ++i) {
    if (lit[i] != 0) {
      dst[i] ^= std::byte{lit[i]};
      last_nonzero = i;
    }
  }
  out.tz = last_nonzero == n ? out.tz + n : n - 1 - last_nonzero;
  out.pos += n;
}

// PutLiterals for up to 16 literals with 16 bytes of output left: one masked 16-byte
// XOR (the bytes past n are rewritten unchanged, all inside this region). `lit` must be
// readable for 16 bytes. With kExactTz false, out.tz becomes a lower bound (0 or 1 when
// n > 0), which is all a repeat offset of 1 needs; a lower bound only ever declines a
// frame (to libzstd), never accepts a wrong one.
template <bool kExactTz>
__attribute__((always_inline)) inline void PutLiteralsShort(Output& out, const uint8_t* lit, size_t n) {
#if defined(__SSE2__)
  alignas(16) static constexpr uint8_t kMask[32] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                                    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  __m128i l = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lit)),
                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMask + 16 - n)));
  auto* dst = reinterpret_cast<__m128i*>(out.region + out.pos);
  _mm_storeu_si128(dst, _mm_xor_si128(_mm_loadu_si128(dst), l));
  if constexpr (kExactTz) {
    unsigned nonzero = ~static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi8(l, _mm_setzero_si128()))) &
                       ((1u << n) - 1);
    out.tz = nonzero == 0 ? out.tz + n : n - 1 - static_cast<size_t>(31 - std::countl_zero(nonzero));
  } else if (n > 0) {
    out.tz = lit[n - 1] == 0 ? 1 : 0;
  }
  out.pos += n;
#else
  PutLiterals(out, lit, n);
#endif
}

// PutLiteralsShort<false> for any number of literals with n + 16 bytes of output left:
// whole 16-byte XORs, then one masked one. `lit` must be readable for n + 16 bytes.
__attribute__((always_inline)) inline void PutLiteralsLong(Output& out, const uint8_t* lit, size_t n) {
#if defined(__SSE2__)
  size_t i = 0;
  for (; i + 16 < n; i += 16) {
    auto* dst = reinterpret_cast<__m128i*>(out.region + out.pos + i);
    _mm_storeu_si128(dst, _mm_xor_si128(_mm_loadu_si128(dst), _mm_loadu_si128(reinterpret_cast<const __m128i*>(lit + i))));
  }
  out.pos += i;
  PutLiteralsShort<false>(out, lit + i, n - i);
#else
  PutLiterals(out, lit, n);
#endif
}

// One decoding table entry of a sequence code with its code tables folded in (libzstd's
// ZSTD_seqSymbol): the length or offset value is `value` + the next `extra` bits, the
// next state `next` + the next `nb` bits.
struct SeqEntry {
  uint32_t value;
  uint16_t next;
  uint8_t extra;
  uint8_t nb;
};

struct SeqTable {
  std::vector<SeqEntry> t;
  unsigned al = 0;
};

void ToSeqTable(const FseTable& f, const uint32_t* base, const uint8_t* bits, SeqTable* out) {
  out->al = f.al;
  out->t.resize(f.t.size());
  for (size_t i = 0; i < f.t.size(); ++i) {
    out->t[i] = SeqEntry{base[f.t[i].sym], f.t[i].base, bits[f.t[i].sym], f.t[i].nb};
  }
}

// Offset codes: value 1 << code, code extra bits.
struct OffsetCodes {
  uint32_t base[32];
  uint8_t bits[32];
  OffsetCodes() {
    for (unsigned c = 0; c < 32; ++c) {
      base[c] = 1u << c;
      bits[c] = static_cast<uint8_t>(c);
    }
  }
};
const OffsetCodes kOf;

// Sequences of FrameWriter's shape, the bulk of every frame it writes: offsets all
// "repeat offset 1" (an RLE offset table) with repeat offset 1 still 1, every literal
// length at least 1 and the last literal of each sequence a zero, so that each match
// copies zeros. A loop of its own, out of line, so that its state (bit container, two
// FSE states, positions) stays in registers: one sequence is one table load per length
// code, one read of at most 50 bits and one unchecked refill. It decodes sequences
// [0, nseq - 1) (the last one reads no state bits) while the bitstream is 8+ bytes from
// its start and returns how many; `lp`, `out`, `b`, `lls`, `mls` advance. SIZE_MAX when
// a sequence is malformed or not of that shape (a literal length of 0 would select
// another repeat offset): the frame then goes to libzstd.
struct Repeat1Loop {
  const SeqEntry* llt;
  const SeqEntry* mlt;
  const uint8_t* lit;
  size_t nlit;
  size_t block_end;
};

__attribute__((always_inline)) inline size_t DecodeRepeat1Body(const Repeat1Loop& c, size_t nseq, BackBits& bits,
                                                               uint32_t& lls_ref, uint32_t& mls_ref, size_t& lp_ref,
                                                               Output& out_ref) {
  BackBits b = bits;
  uint32_t lls = lls_ref, mls = mls_ref;
  const SeqEntry* const llt = c.llt;
  const SeqEntry* const mlt = c.mlt;
  const uint8_t* const lit = c.lit;
  std::byte* const region = out_ref.region;
  const size_t nlit = c.nlit, block_end = c.block_end, size = out_ref.size;
  size_t lp = lp_ref, pos = out_ref.pos, tz = out_ref.tz, left = nseq - 1;
  while (left > 0 && b.FarFromStart()) {
    const SeqEntry L = llt[lls], M = mlt[mls];
    b.RefillUnchecked();
    // Read order: match-length extra bits, literal-length extra bits, then the
    // literal-length and match-length states; the first-read bits are the highest.
    const unsigned sm = M.nb, sl = L.nb;
    uint64_t v = b.ReadUnchecked(M.extra + L.extra + sl + sm);
    mls = M.next + static_cast<uint32_t>(v & ((uint64_t{1} << sm) - 1));
    v >>= sm;
    lls = L.next + static_cast<uint32_t>(v & ((uint64_t{1} << sl) - 1));
    v >>= sl;
    const size_t llen = L.value + static_cast<uint32_t>(v & ((uint64_t{1} << L.extra) - 1));
    const size_t mlen = M.value + static_cast<uint32_t>(v >> L.extra);
    if ((llen - 1 >= nlit - lp) | (llen + mlen > block_end - pos)) return SIZE_MAX;  // llen == 0 wraps
    __builtin_prefetch(region + pos + kRegionPrefetchAhead, 1, 3);
    Output o{region, size, pos, 0};
    if (llen <= 16 && size - pos >= 16) {
      PutLiteralsShort<false>(o, lit + lp, llen);
    } else if (size - pos >= llen + 16) {
      PutLiteralsLong(o, lit + lp, llen);
    } else {
      PutLiterals(o, lit + lp, llen);
    }
    lp += llen;
    if (lit[lp - 1] != 0) return SIZE_MAX;  // the match would copy this nonzero byte
    pos += llen + mlen;
    tz = mlen + 1;  // a lower bound: the zero literal and the match's zeros
    --left;
  }
  out_ref.tz = tz;
  bits = b;
  lls_ref = lls;
  mls_ref = mls;
  lp_ref = lp;
  out_ref.pos = pos;
  return nseq - 1 - left;
}

__attribute__((noinline)) size_t DecodeRepeat1Baseline(const Repeat1Loop& c, size_t nseq, BackBits& bits,
                                                       uint32_t& lls, uint32_t& mls, size_t& lp, Output& out) {
  return DecodeRepeat1Body(c, nseq, bits, lls, mls, lp, out);
}
#if defined(__x86_64__)
__attribute__((noinline, target("bmi,bmi2"))) size_t DecodeRepeat1Bmi2(const Repeat1Loop& c, size_t nseq,
                                                                       BackBits& bits, uint32_t& lls, uint32_t& mls,
                                                                       size_t& lp, Output& out) {
  return DecodeRepeat1Body(c, nseq, bits, lls, mls, lp, out);
}
#endif

size_t DecodeRepeat1(const Repeat1Loop& c, size_t nseq, BackBits& bits, uint32_t& lls, uint32_t& mls, size_t& lp,
                     Output& out) {
#if defined(__x86_64__)
  if (zstd::CpuHasBmi2()) return DecodeRepeat1Bmi2(c, nseq, bits, lls, mls, lp, out);
#endif
  return DecodeRepeat1Baseline(c, nseq, bits, lls, mls, lp, out);
}

}  // namespace

struct SparseApplier::State {
  SeqTable ll_default, ml_default, of_default;
  SeqTable ll_own, ml_own, of_own;  // tables read from the frame
  // The tables in force ("Repeat_Mode" keeps them); null before the first sequences.
  const SeqTable* ll = nullptr;
  const SeqTable* ml = nullptr;
  const SeqTable* of = nullptr;
  zstd::HuffmanTable huf;      // empty before the first Huffman-coded literals block
  std::vector<uint8_t> literals;
  uint32_t reps[3] = {1, 4, 8};
  // "Window_Size" and "Block_Maximum_Size" (min(Window_Size, 128 KiB)) of the frame.
  uint64_t window = 0;
  size_t block_max = kBlockMax;

  State() {
    FseTable f;
    BuildFse(kLlDefault, 35, 6, &f);
    ToSeqTable(f, kLlBase.data(), kLlBits.data(), &ll_default);
    BuildFse(kMlDefault, 52, 6, &f);
    ToSeqTable(f, kMlBase.data(), kMlBits.data(), &ml_default);
    BuildFse(kOfDefault, 28, 5, &f);
    ToSeqTable(f, kOf.base, kOf.bits, &of_default);
    literals.resize(kBlockMax + 32);  // slack for 16-byte reads past the last literal
  }

  // "Literals Section": fills `literals`, returns the section size (0 when malformed).
  size_t ReadLiterals(const uint8_t* p, size_t n, size_t* count) {
    if (n < 1) return 0;
    unsigned type = p[0] & 3, sf = (p[0] >> 2) & 3;
    if (type <= 1) {
      size_t h = sf == 1 ? 2 : sf == 3 ? 3 : 1;
      if (n < h) return 0;
      size_t regen = h == 1 ? p[0] >> 3 : h == 2 ? (p[0] >> 4) + (size_t{p[1]} << 4)
                                                 : (p[0] >> 4) + (size_t{p[1]} << 4) + (size_t{p[2]} << 12);
      if (regen > block_max) return 0;
      *count = regen;
      if (type == 0) {
        if (h + regen > n) return 0;
        std::memcpy(literals.data(), p + h, regen);
        return h + regen;
      }
      if (h + 1 > n) return 0;
      std::memset(literals.data(), p[h], regen);
      return h + 1;
    }
    size_t h = sf <= 1 ? 3 : sf == 2 ? 4 : 5;
    if (n < h) return 0;
    uint64_t v = 0;
    for (size_t i = 0; i < h; ++i) v |= uint64_t{p[i]} << (8 * i);
    size_t regen, csize;
    if (h == 3) {
      regen = (v >> 4) & 0x3FF;
      csize = (v >> 14) & 0x3FF;
    } else if (h == 4) {
      regen = (v >> 4) & 0x3FFF;
      csize = (v >> 18) & 0x3FFF;
    } else {
      regen = (v >> 4) & 0x3FFFF;
      csize = (v >> 22) & 0x3FFFF;
    }
    // libzstd wants 6 literals or more in the "4 streams" layout, and some in any
    // Huffman-coded section.
    if (regen > block_max || h + csize > n || regen == 0 || (sf != 0 && regen < 6)) return 0;
    const uint8_t* q = p + h;
    size_t qn = csize;
    if (type == 2) {
      size_t t = huf.Read(q, qn);
      if (t == 0) return 0;
      q += t;
      qn -= t;
    } else if (huf.empty()) {
      return 0;  // treeless without a previous tree
    }
    *count = regen;
    if (sf == 0) {
      if (!huf.DecodeStream(q, qn, literals.data(), regen)) return 0;
    } else if (!huf.DecodeFourStreams(q, qn, literals.data(), regen)) {
      return 0;
    }
    return h + csize;
  }

  // Reads one table of the "Sequences_Section_Header" and points `cur` at the table in
  // force; returns the bytes read, SIZE_MAX when malformed.
  static size_t ReadTable(unsigned mode, const uint8_t* p, size_t n, const SeqTable& predefined, unsigned max_al,
                          unsigned max_sym, const uint32_t* base, const uint8_t* bits, SeqTable* own,
                          const SeqTable** cur) {
    switch (mode) {
      case 0:
        *cur = &predefined;
        return 0;
      case 1:
        if (n < 1 || p[0] > max_sym) return SIZE_MAX;
        own->t.assign(1, SeqEntry{base[p[0]], 0, bits[p[0]], 0});
        own->al = 0;
        *cur = own;
        return 1;
      case 2: {
        FseTable f;
        size_t used = ReadFse(p, n, max_al, max_sym, &f);
        if (used == 0) return SIZE_MAX;
        ToSeqTable(f, base, bits, own);
        *cur = own;
        return used;
      }
      default:
        return *cur != nullptr ? 0 : SIZE_MAX;
    }
  }

  // "Sequences Section" and "Sequence Execution" in one loop: each sequence's literals
  // are XORed into `out` and its match is skipped when it provably copies zeros. False
  // when malformed or when a match may copy nonzero bytes (some literals may have been
  // applied by then: the caller undoes them by running the same frame again). The
  // block's output ends by `block_end`.
  bool ExecuteSequences(const uint8_t* p, size_t n, size_t nlit, Output& out, size_t block_end) {
    if (n < 1) return false;
    size_t nseq, h;
    if (p[0] < 128) {
      nseq = p[0];
      h = 1;
    } else if (p[0] < 255) {
      if (n < 2) return false;
      nseq = ((p[0] - 128u) << 8) + p[1];
      h = 2;
    } else {
      if (n < 3) return false;
      nseq = p[1] + (size_t{p[2]} << 8) + 0x7F00;
      h = 3;
    }
    if (nseq == 0) {
      if (h != n || nlit > block_end - out.pos) return false;
      PutLiterals(out, literals.data(), nlit);
      return true;
    }
    if (h >= n) return false;
    unsigned modes = p[h++];
    if (modes & 3) return false;
    size_t used;
    if ((used = ReadTable(modes >> 6, p + h, n - h, ll_default, 9, 35, kLlBase.data(), kLlBits.data(), &ll_own,
                          &ll)) == SIZE_MAX) {
      return false;
    }
    h += used;
    if ((used = ReadTable((modes >> 4) & 3, p + h, n - h, of_default, 8, 31, kOf.base, kOf.bits, &of_own, &of)) ==
        SIZE_MAX) {
      return false;
    }
    h += used;
    if ((used = ReadTable((modes >> 2) & 3, p + h, n - h, ml_default, 9, 52, kMlBase.data(), kMlBits.data(), &ml_own,
                          &ml)) == SIZE_MAX) {
      return false;
    }
    h += used;
    BackBits b;
    if (h > n || !b.Init(p + h, n - h)) return false;
    // Offsets all "repeat offset 1" (an RLE table of code 0, what FrameWriter writes):
    // no offset bits, so a sequence reads at most 50 bits and one refill serves it.
    bool rle_of1 = of->al == 0 && of->t[0].value == 1 && of->t[0].extra == 0;
    return rle_of1 ? Execute<true>(b, nseq, nlit, out, block_end) : Execute<false>(b, nseq, nlit, out, block_end);
  }

  // The loop works on local copies of the output position, the bit reader and the
  // repeat offsets: stores into the tensor (std::byte, or SSE vectors) may alias any
  // memory, so members would be reloaded after every literal written.
  template <bool kRleOffset1>
  bool Execute(BackBits& bits, size_t nseq, size_t nlit, Output& out_ref, size_t block_end) {
    Output out = out_ref;
    BackBits b = bits;
    uint32_t r0 = reps[0], r1 = reps[1], r2 = reps[2];
    const SeqEntry* llt = ll->t.data();
    const SeqEntry* mlt = ml->t.data();
    const SeqEntry* oft = of->t.data();
    uint32_t lls = static_cast<uint32_t>(b.Read(ll->al)), ofs = static_cast<uint32_t>(b.Read(of->al)),
             mls = static_cast<uint32_t>(b.Read(ml->al));
    const uint8_t* lit = literals.data();
    size_t lp = 0, first = 0;
    if (kRleOffset1 && r0 == 1) {
      first = DecodeRepeat1(Repeat1Loop{llt, mlt, lit, nlit, block_end}, nseq, b, lls, mls, lp, out);
      if (first == SIZE_MAX) {
        out_ref = out;
        return false;
      }
    }
    bool ok = true;
    for (size_t i = first; i < nseq; ++i) {
      const SeqEntry L = llt[lls], M = mlt[mls], O = oft[ofs];
      uint64_t ofv;
      uint32_t mlen, llen;
      if constexpr (kRleOffset1) {
        // The match-length and literal-length extra bits and the two state updates in
        // one read (at most 50 bits), split afterwards: one step of the bit reader's
        // dependency chain per sequence instead of four.
        const bool fast = b.RefillFast();
        const bool more = i + 1 < nseq;
        const unsigned sl = more ? L.nb : 0, sm = more ? M.nb : 0;
        const unsigned total = M.extra + L.extra + sl + sm;
        uint64_t v = fast ? b.ReadUnchecked(total) : b.Read(total);
        uint32_t mls_bits = static_cast<uint32_t>(v & ((uint64_t{1} << sm) - 1));
        v >>= sm;
        uint32_t lls_bits = static_cast<uint32_t>(v & ((uint64_t{1} << sl) - 1));
        v >>= sl;
        llen = L.value + static_cast<uint32_t>(v & ((uint64_t{1} << L.extra) - 1));
        mlen = M.value + static_cast<uint32_t>(v >> L.extra);
        if (more) {
          lls = L.next + lls_bits;
          mls = M.next + mls_bits;
        }
        ofv = 1;
      } else {
        ofv = O.value + b.Read(O.extra);
        mlen = M.value + static_cast<uint32_t>(b.Read(M.extra));
        llen = L.value + static_cast<uint32_t>(b.Read(L.extra));
        if (i + 1 < nseq) {
          lls = L.next + static_cast<uint32_t>(b.Read(L.nb));
          mls = M.next + static_cast<uint32_t>(b.Read(M.nb));
          ofs = O.next + static_cast<uint32_t>(b.Read(O.nb));
        }
      }
      uint32_t offset;
      if (ofv > 3) {  // "Repeat offsets": a new offset
        offset = static_cast<uint32_t>(ofv - 3);
        r2 = r1;
        r1 = r0;
        r0 = offset;
      } else {
        unsigned idx = static_cast<unsigned>(ofv) - 1 + (llen == 0 ? 1 : 0);
        if (idx == 0) {
          offset = r0;
        } else {
          offset = idx == 1 ? r1 : idx == 2 ? r2 : r0 - 1;
          if (offset == 0) {
            ok = false;
            break;
          }
          if (idx != 1) r2 = r1;
          r1 = r0;
          r0 = offset;
        }
      }
      if (llen > nlit - lp || uint64_t{llen} + mlen > block_end - out.pos) {
        ok = false;
        break;
      }
      // The tensor ahead of the write position, for the load-XOR-store of a later
      // sequence (a hint: it never faults, even past the end of the mapping).
      __builtin_prefetch(out.region + out.pos + kRegionPrefetchAhead, 1, 3);
      if (llen <= 16 && out.size - out.pos >= 16) {
        PutLiteralsShort<!kRleOffset1>(out, lit + lp, llen);
      } else {
        PutLiterals(out, lit + lp, llen);
      }
      lp += llen;
      if (offset > out.tz || offset > window) {  // may copy nonzero bytes, or reaches past the window
        ok = false;
        break;
      }
      out.pos += mlen;
      out.tz += mlen;
    }
    if (ok && (b.remaining() != 0 || nlit - lp > block_end - out.pos)) ok = false;
    if (ok) PutLiterals(out, lit + lp, nlit - lp);
    out_ref = out;
    bits = b;
    reps[0] = r0;
    reps[1] = r1;
    reps[2] = r2;
    return ok;
  }
};

SparseApplier::SparseApplier() : state_(std::make_unique<State>()) {}
SparseApplier::~SparseApplier() = default;

bool SparseApplier::Apply(std::span<const uint8_t> frame, std::span<std::byte> region, Hasher* hasher) {
  // Decoding never reads the region, so a second run of a failed frame XORs exactly the
  // same bytes again and leaves the region as it was.
  auto run = [&](Hasher* h) -> bool {
    State& st = *state_;
    st.reps[0] = 1;
    st.reps[1] = 4;
    st.reps[2] = 8;
    st.huf.clear();
    st.ll = st.of = st.ml = nullptr;
    const uint8_t* p = frame.data();
    size_t n = frame.size();
    if (n < 6 || Le(p, 4) != 0xFD2FB528u) return false;
    unsigned fhd = p[4];
    // Reserved bit, dictionary; and a content checksum, which this decoder does not
    // compute (it never holds the decompressed bytes): libzstd verifies those frames.
    if (fhd & 0x08 || (fhd & 3) != 0 || (fhd & 0x04) != 0) return false;
    bool single = fhd & 0x20;
    unsigned fcs_flag = fhd >> 6;
    size_t fcs_bytes = fcs_flag == 0 ? (single ? 1 : 0) : size_t{1} << fcs_flag;
    size_t at = 5 + (single ? 0 : 1);
    if (at + fcs_bytes > n) return false;
    if (!single) {  // "Window_Descriptor"
      unsigned exponent = p[5] >> 3, mantissa = p[5] & 7;
      if (exponent + 10 > 27) return false;  // keeps the shift and the sum below small
      uint64_t base = uint64_t{1} << (exponent + 10);
      st.window = base + (base / 8) * mantissa;
    }
    if (fcs_bytes > 0) {
      uint64_t fcs = 0;
      for (size_t i = 0; i < fcs_bytes; ++i) fcs |= uint64_t{p[at + i]} << (8 * i);
      if (fcs_bytes == 2) fcs += 256;
      if (fcs != region.size()) return false;
      if (single) st.window = fcs;
    }
    // Over 2^27 bytes (exponent 17 with a mantissa, or a single segment's content size)
    // libzstd's streaming decoder refuses the frame (its default limit), and so does
    // this decoder.
    if (st.window > kMaxWindow) return false;
    st.block_max = static_cast<size_t>(std::min<uint64_t>(st.window, kBlockMax));
    at += fcs_bytes;
    Output out{region.data(), region.size()};
    size_t hashed = 0;
    for (;;) {
      if (at + 3 > n) return false;
      uint32_t bh = Le(p + at, 3);
      at += 3;
      bool last = bh & 1;
      unsigned type = (bh >> 1) & 3;
      size_t size = bh >> 3;
      // Every block, raw and RLE too, holds at most Block_Maximum_Size bytes; a
      // compressed one is also smaller than 128 KiB on the wire (libzstd's limit).
      if (size > st.block_max || (type == 2 && size >= kBlockMax)) return false;
      if (type == 0) {  // "Raw_Block"
        if (at + size > n || size > out.size - out.pos) return false;
        PutLiterals(out, p + at, size);
        at += size;
      } else if (type == 1) {  // "RLE_Block"
        if (at + 1 > n || size > out.size - out.pos) return false;
        if (p[at] != 0) {
          for (size_t i = 0; i < size; ++i) out.region[out.pos + i] ^= std::byte{p[at]};
        }
        out.tz = p[at] != 0 ? 0 : out.tz + size;
        out.pos += size;
        at += 1;
      } else if (type == 2) {  // "Compressed_Block"
        if (at + size > n) return false;
        size_t nlit = 0, lsize = st.ReadLiterals(p + at, size, &nlit);
        size_t block_end = out.pos + std::min(st.block_max, out.size - out.pos);
        if (lsize == 0 || !st.ExecuteSequences(p + at + lsize, size - lsize, nlit, out, block_end)) return false;
        at += size;
      } else {
        return false;
      }
      if (h != nullptr) {  // the block just written is still in cache
        h->Update(std::span<const std::byte>(out.region + hashed, out.pos - hashed));
        hashed = out.pos;
      }
      if (last) break;
    }
    return at == n && out.pos == out.size;
  };
  if (run(hasher)) return true;
  (void)run(nullptr);
  return false;
}

}  // namespace wsync::delta
