#include "backends/delta/zstd_writer.h"

#include <algorithm>
#include <bit>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "backends/delta/apply/zstd_decode.h"
#include "backends/delta/nonzero_mask.h"
#include "backends/delta/zstd_format.h"

// Section names below are RFC 8878's; the encoding order of every bitstream mirrors
// libzstd's compressor (FSE_compress_usingCTable, HUF_compress1X, ZSTD_encodeSequences),
// since that is the order every decoder undoes.
namespace wsync::delta::zstd {
namespace {

constexpr unsigned kSeqAl = 9;     // accuracy of the literal- and match-length tables
constexpr unsigned kWeightAl = 6;  // accuracy of the Huffman weights' table (the maximum)
constexpr unsigned kHufMaxBits = 11;
constexpr size_t kMinHufLiterals = 64;  // fewer literals stay raw
constexpr size_t kFourStreams = 256;    // from this many literals on, four Huffman streams

inline unsigned HighBit(uint32_t v) { return 31 - std::countl_zero(v); }

struct CodeTables {
  uint8_t ll[64];
  uint8_t ml[128];
  CodeTables() {
    for (uint32_t v = 0; v < 64; ++v) {
      unsigned c = 0;
      while (c + 1 < kLlBase.size() && kLlBase[c + 1] <= v) ++c;
      ll[v] = static_cast<uint8_t>(c);
    }
    for (uint32_t v = 0; v < 128; ++v) {
      unsigned c = 0;
      while (c + 1 < kMlBase.size() && kMlBase[c + 1] <= v + 3) ++c;
      ml[v] = static_cast<uint8_t>(c);
    }
  }
};
const CodeTables kCodes;

// Branch-free (a select, not a jump): long lengths are rare but unpredictable.
inline unsigned LlCode(uint32_t ll) {
  unsigned small = kCodes.ll[std::min<uint32_t>(ll, 63)];
  return ll < 64 ? small : HighBit(ll) + 19;
}
inline unsigned MlCode(uint32_t ml) {  // ml >= 3
  uint32_t b = ml - 3;
  unsigned small = kCodes.ml[std::min<uint32_t>(b, 127)];
  return b < 128 ? small : HighBit(b | 1) + 36;
}

// Code lengths of a Huffman code for `counts` (two-queue merge over sorted leaves);
// returns the longest, 0 when fewer than two symbols are present.
unsigned HuffmanLengths(const uint32_t* counts, uint8_t* len) {
  std::array<std::pair<uint32_t, uint16_t>, 256> leaves;
  size_t n = 0;
  for (unsigned s = 0; s < 256; ++s) {
    len[s] = 0;
    if (counts[s] != 0) leaves[n++] = {counts[s], static_cast<uint16_t>(s)};
  }
  if (n < 2) return 0;
  std::sort(leaves.begin(), leaves.begin() + n);
  std::array<uint64_t, 512> weight;
  std::array<uint16_t, 512> parent;
  for (size_t i = 0; i < n; ++i) weight[i] = leaves[i].first;
  size_t leaf = 0, inner = n;
  auto pop = [&](size_t end) {
    if (leaf < n && (inner >= end || weight[leaf] <= weight[inner])) return leaf++;
    return inner++;
  };
  for (size_t node = n; node < 2 * n - 1; ++node) {
    size_t a = pop(node), b = pop(node);
    weight[node] = weight[a] + weight[b];
    parent[a] = parent[b] = static_cast<uint16_t>(node);
  }
  std::array<uint8_t, 512> depth;
  depth[2 * n - 2] = 0;
  unsigned longest = 0;
  for (size_t k = 2 * n - 2; k-- > 0;) {
    depth[k] = static_cast<uint8_t>(depth[parent[k]] + 1);
    if (k < n) {
      len[leaves[k].second] = depth[k];
      longest = std::max<unsigned>(longest, depth[k]);
    }
  }
  return longest;
}

}  // namespace

void BuildFseCTable(const int16_t* norm, unsigned max_sym, unsigned al, FseCTable* out) {
  const uint32_t size = 1u << al;
  out->al = al;
  out->next.assign(size, 0);
  out->sym.fill(FseCTable::Sym{});
  std::array<uint8_t, 512> table_sym{};
  std::array<uint32_t, 257> cumul{};
  uint32_t high = size - 1;
  for (unsigned u = 1; u <= max_sym + 1; ++u) {
    if (norm[u - 1] == -1) {
      cumul[u] = cumul[u - 1] + 1;
      table_sym[high--] = static_cast<uint8_t>(u - 1);
    } else {
      cumul[u] = cumul[u - 1] + static_cast<uint32_t>(norm[u - 1]);
    }
  }
  uint32_t step = (size >> 1) + (size >> 3) + 3, mask = size - 1, pos = 0;
  for (unsigned s = 0; s <= max_sym; ++s) {
    for (int i = 0; i < norm[s]; ++i) {
      table_sym[pos] = static_cast<uint8_t>(s);
      do pos = (pos + step) & mask;
      while (pos > high);
    }
  }
  for (uint32_t u = 0; u < size; ++u) out->next[cumul[table_sym[u]]++] = static_cast<uint16_t>(size + u);
  int32_t total = 0;
  for (unsigned s = 0; s <= max_sym; ++s) {
    FseCTable::Sym& e = out->sym[s];
    if (norm[s] == 0) {
      e.delta_nb = ((al + 1) << 16) - size;
    } else if (norm[s] == -1 || norm[s] == 1) {
      e.delta_nb = (al << 16) - size;
      e.find_state = total - 1;
      ++total;
    } else {
      uint32_t max_bits_out = al - HighBit(static_cast<uint32_t>(norm[s]) - 1);
      uint32_t min_state_plus = static_cast<uint32_t>(norm[s]) << max_bits_out;
      e.delta_nb = (max_bits_out << 16) - min_state_plus;
      e.find_state = total - norm[s];
      total += norm[s];
    }
  }
}

bool NormalizeCounts(const uint32_t* counts, unsigned max_sym, unsigned al, int16_t* norm) {
  const int target = 1 << al;
  uint64_t total = 0;
  int present = 0;
  for (unsigned s = 0; s <= max_sym; ++s) {
    total += counts[s];
    present += counts[s] != 0;
  }
  if (total == 0 || present > target) return false;
  int sum = 0;
  for (unsigned s = 0; s <= max_sym; ++s) {
    if (counts[s] == 0) {
      norm[s] = 0;
      continue;
    }
    int v = static_cast<int>(counts[s] * static_cast<uint64_t>(target) / total);
    norm[s] = static_cast<int16_t>(std::max(v, 1));
    sum += norm[s];
  }
  while (sum != target) {  // the largest symbols absorb the rounding
    unsigned big = 0;
    for (unsigned s = 1; s <= max_sym; ++s) {
      if (norm[s] > norm[big]) big = s;
    }
    if (sum < target) {
      norm[big] = static_cast<int16_t>(norm[big] + (target - sum));
      sum = target;
    } else {
      int take = std::min(sum - target, norm[big] - 1);
      if (take <= 0) return false;
      norm[big] = static_cast<int16_t>(norm[big] - take);
      sum -= take;
    }
  }
  return true;
}

size_t WriteFseTable(const int16_t* norm, unsigned max_sym, unsigned al, uint8_t* out) {
  uint8_t* o = out;
  uint64_t bits = al - 5;
  unsigned nbits = 4;
  auto flush16 = [&] {
    if (nbits >= 16) {
      o[0] = static_cast<uint8_t>(bits);
      o[1] = static_cast<uint8_t>(bits >> 8);
      o += 2;
      bits >>= 16;
      nbits -= 16;
    }
  };
  int remaining = (1 << al) + 1, threshold = 1 << al, nb = static_cast<int>(al) + 1;
  unsigned s = 0;
  bool previous0 = false;
  while (s <= max_sym && remaining > 1) {
    if (previous0) {
      unsigned start = s;
      while (s <= max_sym && norm[s] == 0) ++s;
      while (s >= start + 24) {
        start += 24;
        bits |= uint64_t{0xFFFF} << nbits;
        nbits += 16;
        flush16();
      }
      while (s >= start + 3) {
        start += 3;
        bits |= uint64_t{3} << nbits;
        nbits += 2;
      }
      bits |= uint64_t{s - start} << nbits;
      nbits += 2;
      flush16();
    }
    int count = norm[s++];
    int max = (2 * threshold - 1) - remaining;
    remaining -= count < 0 ? -count : count;
    ++count;
    if (count >= threshold) count += max;
    bits |= static_cast<uint64_t>(count) << nbits;
    nbits += static_cast<unsigned>(nb) - (count < max ? 1 : 0);
    previous0 = count == 1;
    while (remaining < threshold) {
      --nb;
      threshold >>= 1;
    }
    flush16();
  }
  while (nbits > 0) {
    *o++ = static_cast<uint8_t>(bits);
    bits >>= 8;
    nbits = nbits > 8 ? nbits - 8 : 0;
  }
  return static_cast<size_t>(o - out);
}

bool BuildHuffman(const uint32_t* counts_in, HufCTable* out) {
  std::array<uint32_t, 256> counts;
  std::copy(counts_in, counts_in + 256, counts.begin());
  unsigned longest = 0;
  for (;;) {  // flatten the counts until the code fits in 11 bits
    longest = HuffmanLengths(counts.data(), out->len.data());
    if (longest == 0) return false;
    if (longest <= kHufMaxBits) break;
    for (auto& c : counts) c = c == 0 ? 0 : (c >> 1) | 1;
  }
  // Weights, and canonical codes in the order a decoder lays out its table: by weight
  // (longest codes first), then by symbol.
  std::array<uint8_t, 256> w{};
  unsigned last = 0;
  for (unsigned s = 0; s < 256; ++s) {
    if (out->len[s] != 0) {
      w[s] = static_cast<uint8_t>(longest + 1 - out->len[s]);
      last = s;
    }
  }
  uint32_t start = 0;
  for (unsigned weight = 1; weight <= longest; ++weight) {
    for (unsigned s = 0; s < 256; ++s) {
      if (w[s] != weight) continue;
      out->code[s] = static_cast<uint16_t>(start >> (weight - 1));
      start += 1u << (weight - 1);
    }
  }
  // "Huffman Tree Description": the weights of symbols 0..last-1 (the last one's is
  // implied), as 4-bit values when they fit, else FSE-compressed.
  std::vector<uint8_t>& d = out->description;
  d.assign(256, 0);
  if (last <= 128) {
    d[0] = static_cast<uint8_t>(127 + last);
    for (unsigned i = 0; i < last; ++i) d[1 + i / 2] |= static_cast<uint8_t>(i % 2 == 0 ? w[i] << 4 : w[i]);
    d.resize(1 + (last + 1) / 2);
  } else {
    std::array<uint32_t, 16> hist{};
    unsigned max_w = 0, distinct = 0;
    for (unsigned i = 0; i < last; ++i) {
      distinct += hist[w[i]]++ == 0;
      max_w = std::max<unsigned>(max_w, w[i]);
    }
    if (distinct < 2) return false;  // a one-symbol FSE stream has no length
    std::array<int16_t, 16> norm{};
    if (!NormalizeCounts(hist.data(), max_w, kWeightAl, norm.data())) return false;
    size_t th = WriteFseTable(norm.data(), max_w, kWeightAl, d.data() + 1);
    FseCTable t;
    BuildFseCTable(norm.data(), max_w, kWeightAl, &t);
    uint8_t stream[256];
    BitWriter bw(stream);
    FseState s1, s2;
    size_t i = last;
    if (i % 2 == 1) {
      s1.Init(t, w[--i]);
      s2.Init(t, w[--i]);
      s1.Encode(bw, t, w[--i]);
    } else {
      s2.Init(t, w[--i]);
      s1.Init(t, w[--i]);
    }
    bw.Flush();
    while (i > 0) {
      s2.Encode(bw, t, w[--i]);
      s1.Encode(bw, t, w[--i]);
      bw.Flush();
    }
    s2.Finish(bw, t);
    s1.Finish(bw, t);
    size_t sn = bw.Close();
    if (1 + th + sn >= 128 + 1) return false;
    std::memcpy(d.data() + 1 + th, stream, sn);
    d[0] = static_cast<uint8_t>(th + sn);
    d.resize(1 + th + sn);
  }
  // The description must give a decoder exactly this code (it is read once per frame).
  HuffmanTable check;
  if (check.Read(d.data(), d.size()) != d.size()) return false;
  return check.CodeLengths() == out->len;
}

FrameWriter::FrameWriter() {
  seqs_.resize(kMaxBlock / 4 + 2);
  lits_.resize(kMaxBlock + 64);
  scratch_.resize(4 * kMaxBlock + 4096);
  ll_code_.resize(kMaxBlock / 4 + 2);
  ml_code_.resize(kMaxBlock / 4 + 2);
  pos_.resize(kMaxBlock + 64);
}

uint8_t* FrameWriter::Reserve(size_t n) {
  std::vector<uint8_t>& o = *out_;
  if (o.size() < *used_ + n) o.resize(std::max(o.size() * 2, *used_ + n));
  return o.data() + *used_;
}

void FrameWriter::PutBlockHeader(uint8_t* p, bool last, unsigned type, size_t size) {
  uint32_t h = (last ? 1u : 0u) | (type << 1) | static_cast<uint32_t>(size << 3);
  p[0] = static_cast<uint8_t>(h);
  p[1] = static_cast<uint8_t>(h >> 8);
  p[2] = static_cast<uint8_t>(h >> 16);
}

size_t FrameWriter::WriteFrameHeader(uint64_t content_size, uint8_t* p) {
  const uint32_t magic = 0xFD2FB528u;
  std::memcpy(p, &magic, 4);
  bool big = content_size > 0xFFFFFFFFull;
  p[4] = big ? 0xC0 : 0x80;           // Frame_Header_Descriptor: FCS 8 or 4 bytes, no checksum
  p[5] = (17 - 10) << 3;              // Window_Descriptor: 128 KiB, one block
  for (int i = 0; i < (big ? 8 : 4); ++i) p[6 + i] = static_cast<uint8_t>(content_size >> (8 * i));
  return big ? 14 : 10;
}

void FrameWriter::BeginPart(std::vector<uint8_t>* out, size_t* used) {
  out_ = out;
  used_ = used;
  huf_valid_ = huf_failed_ = seq_valid_ = false;
  huf_from_ = seq_from_ = 0;
}

void FrameWriter::Begin(uint64_t content_size, std::vector<uint8_t>* out, size_t* used) {
  BeginPart(out, used);
  *used_ += WriteFrameHeader(content_size, Reserve(kMaxFrameHeader + 4));
}

std::vector<uint8_t> FrameWriter::ZeroFrame(uint64_t content_size) {
  const uint64_t blocks = std::max<uint64_t>(1, (content_size + kMaxBlock - 1) / kMaxBlock);
  std::vector<uint8_t> out(kMaxFrameHeader + 4 * blocks);
  size_t used = WriteFrameHeader(content_size, out.data());
  uint64_t n = content_size;
  do {
    size_t b = static_cast<size_t>(std::min<uint64_t>(n, kMaxBlock));
    n -= b;
    PutBlockHeader(out.data() + used, n == 0, 1, b);
    out[used + 3] = 0;
    used += 4;
  } while (n > 0);
  out.resize(used);
  return out;
}

void FrameWriter::AddZeros(uint64_t n, bool last) {
  do {
    size_t b = static_cast<size_t>(std::min<uint64_t>(n, kMaxBlock));
    n -= b;
    uint8_t* p = Reserve(4);
    PutBlockHeader(p, last && n == 0, 1, b);
    p[3] = 0;
    *used_ += 4;
  } while (n > 0);
}

namespace {

#if defined(__x86_64__)
__attribute__((target("avx2"), always_inline)) inline uint64_t NonzeroMask64Avx2(const uint8_t* p) {
  const __m256i zero = _mm256_setzero_si256();
  __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  uint64_t lo = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(a, zero)));
  uint64_t hi = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(b, zero)));
  return ~(lo | hi << 32);
}
#endif

// The lowest set bit's index, any value when m == 0: unlike std::countr_zero, which
// GCC guards with a branch on m == 0 (a mispredicted one in the loop below, where the
// number of changes per chunk is random), the forced top bit makes it one tzcnt/bsf.
inline uint32_t LowBitOrJunk(uint64_t m) { return static_cast<uint32_t>(__builtin_ctzll(m | (uint64_t{1} << 63))); }

// Writes the positions of the changed bytes of p[0, n) to `pos` (n + 64 slots) and
// returns their number. Four positions per step, so that the loop branches once per
// four changes (most 64-byte chunks have fewer) instead of once per change; slots past
// a chunk's count hold junk that the next chunk overwrites. A macro so that it compiles
// inside functions of different target ISAs (`MASK64` reads a full 64-byte chunk);
// `STEP` runs once per chunk.
#define WSYNC_SCAN_POSITIONS(MASK_AT_BASE, STEP)                                                \
  size_t np = 0;                                                                                \
  for (size_t base = 0; base < n; base += 64) {                                                 \
    uint64_t mask = MASK_AT_BASE;                                                               \
    STEP;                                                                                       \
    uint32_t* w = pos + np;                                                                     \
    np += static_cast<size_t>(std::popcount(mask));                                             \
    const uint32_t b = static_cast<uint32_t>(base);                                             \
    do {                                                                                        \
      w[0] = b + LowBitOrJunk(mask);                                                            \
      mask &= mask - 1;                                                                         \
      w[1] = b + LowBitOrJunk(mask);                                                            \
      mask &= mask - 1;                                                                         \
      w[2] = b + LowBitOrJunk(mask);                                                            \
      mask &= mask - 1;                                                                         \
      w[3] = b + LowBitOrJunk(mask);                                                            \
      mask &= mask - 1;                                                                         \
      w += 4;                                                                                   \
    } while (mask != 0);                                                                        \
  }                                                                                             \
  return np;

size_t ScanPositionsBaseline(const uint8_t* p, size_t n, uint32_t* pos) {
  WSYNC_SCAN_POSITIONS(NonzeroMask(p + base, std::min<size_t>(64, n - base)), (void)0)
}
size_t MaskPositionsBaseline(const uint64_t* masks, size_t n, uint32_t* pos, Prefetch& ahead) {
  WSYNC_SCAN_POSITIONS(masks[base / 64], ahead.Step())
}

// The same for CPUs with AVX2/BMI/POPCNT, chosen at run time.
#if defined(__x86_64__)
__attribute__((target("avx2,bmi,bmi2,popcnt,lzcnt"))) size_t ScanPositionsAvx2(const uint8_t* p, size_t n,
                                                                               uint32_t* pos) {
  WSYNC_SCAN_POSITIONS(n - base >= 64 ? NonzeroMask64Avx2(p + base) : NonzeroMask(p + base, n - base), (void)0)
}
__attribute__((target("bmi,popcnt"))) size_t MaskPositionsBmi(const uint64_t* masks, size_t n, uint32_t* pos,
                                                              Prefetch& ahead) {
  WSYNC_SCAN_POSITIONS(masks[base / 64], ahead.Step())
}
IsaChoice avx2(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
               __builtin_cpu_supports("popcnt"));
#endif
#undef WSYNC_SCAN_POSITIONS

}  // namespace

bool Avx2Enabled() {
#if defined(__x86_64__)
  return avx2.enabled();
#else
  return false;
#endif
}

void UseBaselineIsaForTesting(bool baseline) {
#if defined(__x86_64__)
  avx2.UseBaseline(baseline);
#endif
  UseBaselineDecodeForTesting(baseline);
}

size_t FrameWriter::Scan(const uint8_t* p, size_t n, const uint64_t* masks, Prefetch& ahead) {
  // The positions of the changed bytes first (from the caller's masks when it has them).
  uint32_t* pos = pos_.data();
#if defined(__x86_64__)
  const bool fast = avx2.enabled();
  size_t np = masks != nullptr ? (fast ? MaskPositionsBmi(masks, n, pos, ahead) : MaskPositionsBaseline(masks, n, pos, ahead))
              : fast           ? ScanPositionsAvx2(p, n, pos)
                               : ScanPositionsBaseline(p, n, pos);
#else
  size_t np = masks != nullptr ? MaskPositionsBaseline(masks, n, pos, ahead) : ScanPositionsBaseline(p, n, pos);
#endif
  // Then one sequence per zero run of four or more bytes: literals [lit_from, zero_start]
  // (the changed bytes and one zero), a match over the rest of the run.
  Seq* seq = seqs_.data();
  uint8_t* llc = ll_code_.data();
  uint8_t* mlc = ml_code_.data();
  uint8_t* lit = lits_.data();
  size_t count = 0, nlit = 0, zero_start = 0, lit_from = 0;
  auto sequence = [&](size_t end) {
    uint32_t ll = static_cast<uint32_t>(zero_start + 1 - lit_from);
    if (ll <= 16) {
      std::memcpy(lit + nlit, p + lit_from, 16);
    } else {
      std::memcpy(lit + nlit, p + lit_from, ll);
    }
    nlit += ll;
    uint32_t ml = static_cast<uint32_t>(end - zero_start - 1);
    seq[count] = Seq{ll, ml};
    llc[count] = static_cast<uint8_t>(LlCode(ll));
    mlc[count] = static_cast<uint8_t>(MlCode(ml));
    ++count;
    lit_from = end;
  };
  for (size_t k = 0; k < np; ++k) {
    size_t q = pos[k];
    if (q - zero_start >= 4) sequence(q);
    zero_start = q + 1;
  }
  if (n - zero_start >= 4) sequence(n);
  std::memcpy(lit + nlit, p + lit_from, n - lit_from);  // the last literals
  nlit += n - lit_from;
  seqs_count_ = count;
  return nlit;
}

size_t FrameWriter::WriteLiterals(const uint8_t* lit, size_t n, uint8_t* out) {
  fresh_huf_ = false;
  if (n >= kMinHufLiterals && !huf_failed_) {
    bool fresh = !huf_valid_ || (huf_from_ < 4096 && n > 4 * huf_from_);
    if (fresh) {
      std::array<uint32_t, 256> hist{};
      for (size_t i = 0; i < n; ++i) ++hist[lit[i]];
      for (auto& c : hist) c = 2 * c + 1;  // every byte value stays codable in later blocks
      if (!BuildHuffman(hist.data(), &huf_next_)) {
        fresh = false;
        if (!huf_valid_) huf_failed_ = true;
      }
    }
    if (huf_valid_ || fresh) {
      const HufCTable& t = fresh ? huf_next_ : huf_;
      auto stream = [&t](const uint8_t* src, size_t count, uint8_t* dst) {
        BitWriter w(dst);
        size_t i = count;
        while (i & 3) {
          --i;
          w.Add(t.code[src[i]], t.len[src[i]]);
        }
        w.Flush();
        while (i > 0) {
          i -= 4;
          w.Add(t.code[src[i + 3]], t.len[src[i + 3]]);
          w.Add(t.code[src[i + 2]], t.len[src[i + 2]]);
          w.Add(t.code[src[i + 1]], t.len[src[i + 1]]);
          w.Add(t.code[src[i]], t.len[src[i]]);
          w.Flush();
        }
        return w.Close();
      };
      // Only a section smaller than the raw literals is kept, so both size fields are
      // below n and the header size follows from n alone.
      bool four = n >= kFourStreams;
      unsigned sf = !four ? 0 : n < 1024 ? 1 : n < 16384 ? 2 : 3;
      size_t h = sf <= 1 ? 3 : sf == 2 ? 4 : 5;
      uint8_t* body = out + h;
      size_t dn = 0;
      if (fresh) {
        std::memcpy(body, t.description.data(), t.description.size());
        dn = t.description.size();
      }
      size_t csize;
      if (four) {
        size_t per = (n + 3) / 4;
        uint8_t* jump = body + dn;
        uint8_t* s = jump + 6;
        for (int k = 0; k < 4; ++k) {
          size_t size = stream(lit + k * per, k < 3 ? per : n - 3 * per, s);
          if (k < 3) {
            jump[2 * k] = static_cast<uint8_t>(size);
            jump[2 * k + 1] = static_cast<uint8_t>(size >> 8);
          }
          s += size;
        }
        csize = static_cast<size_t>(s - body);
      } else {
        csize = dn + stream(lit, n, body + dn);
      }
      if (h + csize < n) {  // then also each stream < 64 KiB
        uint64_t v = (fresh ? 2u : 3u) | (sf << 2) | (uint64_t{n} << 4);
        v |= uint64_t{csize} << (h == 3 ? 14 : h == 4 ? 18 : 22);
        for (size_t i = 0; i < h; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
        fresh_huf_ = fresh;
        return h + csize;
      }
    }
  }
  // "Raw_Literals_Block".
  size_t h;
  if (n < 32) {
    out[0] = static_cast<uint8_t>(n << 3);
    h = 1;
  } else if (n < 4096) {
    out[0] = static_cast<uint8_t>((1 << 2) | (n << 4));
    out[1] = static_cast<uint8_t>(n >> 4);
    h = 2;
  } else {
    out[0] = static_cast<uint8_t>((3 << 2) | (n << 4));
    out[1] = static_cast<uint8_t>(n >> 4);
    out[2] = static_cast<uint8_t>(n >> 12);
    h = 3;
  }
  std::memcpy(out + h, lit, n);
  return h + n;
}

size_t FrameWriter::WriteSequences(uint8_t* out, Prefetch& ahead) {
  const size_t n = seqs_count_;
  uint8_t* o = out;
  if (n < 128) {
    *o++ = static_cast<uint8_t>(n);
  } else if (n < 0x7F00) {
    *o++ = static_cast<uint8_t>((n >> 8) + 0x80);
    *o++ = static_cast<uint8_t>(n);
  } else {
    *o++ = 0xFF;
    *o++ = static_cast<uint8_t>(n - 0x7F00);
    *o++ = static_cast<uint8_t>((n - 0x7F00) >> 8);
  }
  if (n == 0) return static_cast<size_t>(o - out);
  const Seq* seq = seqs_.data();
  const uint8_t* llc = ll_code_.data();
  const uint8_t* mlc = ml_code_.data();
  fresh_seq_ = !seq_valid_ || (seq_from_ < 1024 && n > 4 * seq_from_);
  uint8_t* modes = o++;
  if (fresh_seq_) {
    // Tables from this block's lengths, every symbol kept codable for the later blocks
    // that repeat them.
    std::array<uint32_t, 36> llh{};
    std::array<uint32_t, 53> mlh{};
    for (size_t i = 0; i < n; ++i) {
      ++llh[llc[i]];
      ++mlh[mlc[i]];
    }
    for (auto& c : llh) c = 4 * c + 1;
    for (auto& c : mlh) c = 4 * c + 1;
    NormalizeCounts(llh.data(), 35, kSeqAl, ll_norm_.data());
    NormalizeCounts(mlh.data(), 52, kSeqAl, ml_norm_.data());
    BuildFseCTable(ll_norm_.data(), 35, kSeqAl, &ll_next_);
    BuildFseCTable(ml_norm_.data(), 52, kSeqAl, &ml_next_);
    *modes = (2 << 6) | (1 << 4) | (2 << 2);  // FSE_Compressed, RLE offsets, FSE_Compressed
    o += WriteFseTable(ll_norm_.data(), 35, kSeqAl, o);
    *o++ = 0;  // offset code 0: repeat offset 1
    o += WriteFseTable(ml_norm_.data(), 52, kSeqAl, o);
  } else {
    *modes = (3 << 6) | (1 << 4) | (3 << 2);  // Repeat, RLE offsets, Repeat
    *o++ = 0;
  }
  const FseCTable& ll = fresh_seq_ ? ll_next_ : ll_;
  const FseCTable& ml = fresh_seq_ ? ml_next_ : ml_;
  BitWriter w(o);
  FseState lls, mls;
  size_t last = n - 1;
  mls.Init(ml, mlc[last]);
  lls.Init(ll, llc[last]);
  w.Add(seq[last].ll - kLlBase[llc[last]], kLlBits[llc[last]]);
  w.Add(seq[last].ml - kMlBase[mlc[last]], kMlBits[mlc[last]]);
  w.Flush();
  for (size_t i = last; i-- > 0;) {
    unsigned lc = llc[i], mc = mlc[i];
    ahead.Step();
    mls.Encode(w, ml, mc);
    lls.Encode(w, ll, lc);
    w.Add(seq[i].ll - kLlBase[lc], kLlBits[lc]);
    w.Add(seq[i].ml - kMlBase[mc], kMlBits[mc]);
    w.Flush();
  }
  mls.Finish(w, ml);
  lls.Finish(w, ll);
  o += w.Close();
  return static_cast<size_t>(o - out);
}

void FrameWriter::AddBlock(const uint8_t* patch, size_t n, bool last, const uint64_t* masks, Prefetch ahead) {
  size_t nlit = Scan(patch, n, masks, ahead);
  uint8_t* b = scratch_.data() + 3;
  size_t size = WriteLiterals(lits_.data(), nlit, b);
  fresh_seq_ = false;
  size += WriteSequences(b + size, ahead);
  if (size < n) {
    PutBlockHeader(scratch_.data(), last, 2, size);
    std::memcpy(Reserve(size + 3), scratch_.data(), size + 3);
    *used_ += size + 3;
    if (fresh_huf_) {
      std::swap(huf_, huf_next_);
      huf_valid_ = true;
      huf_from_ = nlit;
    }
    if (seqs_count_ > 0 && fresh_seq_) {
      std::swap(ll_, ll_next_);
      std::swap(ml_, ml_next_);
      seq_valid_ = true;
      seq_from_ = seqs_count_;
    }
    return;
  }
  // "Raw_Block" (tables built for this attempt are dropped: no decoder saw them).
  uint8_t* p = Reserve(n + 3);
  PutBlockHeader(p, last, 0, n);
  std::memcpy(p + 3, patch, n);
  *used_ += n + 3;
}

}  // namespace wsync::delta::zstd
