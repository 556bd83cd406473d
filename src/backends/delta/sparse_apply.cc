#include "backends/delta/sparse_apply.h"

#include <array>
#include <bit>
#include <cstring>
#include <vector>

// The decoder follows RFC 8878 (doc/zstd_compression_format.md in the zstd sources);
// section names below are the RFC's. Every read is bounds-checked: malformed input ends
// in `false`, never in a read outside the frame.
namespace wsync::delta {
namespace {

constexpr size_t kBlockMax = 128 * 1024;

uint32_t Le(const uint8_t* p, int n) {
  uint32_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Bits of a backward stream (FSE, Huffman): the last byte's highest set bit is the end
// marker; reading proceeds from just below it toward the first byte, through a 64-bit
// container refilled 8 bytes at a time (libzstd's BIT_DStream scheme). Read(n) returns
// the next n bits with the first-read bit as the most significant. Bits before the
// start read as zero, and remaining() < 0 then tells the stream was overrun.
class BackBits {
 public:
  bool Init(const uint8_t* p, size_t n) {
    if (n == 0 || p[n - 1] == 0) return false;
    start_ = p;
    unsigned marker = 8 - (31 - std::countl_zero(static_cast<uint32_t>(p[n - 1])));  // padding + marker bits
    if (n >= 8) {
      ptr_ = p + n - 8;
      std::memcpy(&container_, ptr_, 8);
      consumed_ = marker;
    } else {
      ptr_ = p;
      container_ = 0;
      for (size_t i = 0; i < n; ++i) container_ |= uint64_t{p[i]} << (8 * i);
      consumed_ = marker + 8 * (8 - static_cast<unsigned>(n));
    }
    return true;
  }
  // Up to 56 bits (a refill happens first when needed).
  uint64_t Peek(unsigned n) {
    if (consumed_ + n > 64) Refill();
    if (n == 0 || consumed_ >= 64) return 0;
    return (container_ << consumed_) >> (64 - n);
  }
  void Skip(unsigned n) { consumed_ += n; }
  uint64_t Read(unsigned n) {
    uint64_t v = Peek(n);
    consumed_ += n;
    return v;
  }
  // Bits left; negative when more were read than the stream holds.
  int64_t remaining() const { return static_cast<int64_t>(ptr_ - start_) * 8 + 64 - static_cast<int64_t>(consumed_); }

 private:
  void Refill() {
    if (consumed_ > 64) return;  // overrun: stays overrun
    size_t back = consumed_ >> 3;
    size_t avail = static_cast<size_t>(ptr_ - start_);
    if (back > avail) back = avail;
    if (back == 0) return;
    ptr_ -= back;
    consumed_ -= 8 * static_cast<unsigned>(back);
    std::memcpy(&container_, ptr_, 8);
  }
  const uint8_t* start_ = nullptr;
  const uint8_t* ptr_ = nullptr;
  uint64_t container_ = 0;
  unsigned consumed_ = 0;
};

// Forward little-endian bits (FSE table descriptions).
struct FwdBits {
  const uint8_t* p;
  size_t n;
  size_t pos = 0;  // bits consumed
  bool overrun = false;
  uint32_t Peek(unsigned k) {
    uint64_t w = 0;
    size_t byte = pos >> 3;
    for (size_t i = 0; i < 5 && byte + i < n; ++i) w |= uint64_t{p[byte + i]} << (8 * i);
    if (pos + k > 8 * n) overrun = true;
    return static_cast<uint32_t>((w >> (pos & 7)) & ((uint64_t{1} << k) - 1));
  }
  uint32_t Read(unsigned k) {
    uint32_t v = Peek(k);
    pos += k;
    return v;
  }
};

struct FseEntry {
  uint16_t base = 0;
  uint8_t nb = 0;
  uint8_t sym = 0;
};

struct FseTable {
  std::vector<FseEntry> t;
  unsigned al = 0;
  bool valid = false;
};

// "From normalized distribution to decoding tables".
bool BuildFse(const int16_t* norm, unsigned max_sym, unsigned al, FseTable* out) {
  size_t size = size_t{1} << al;
  out->t.assign(size, FseEntry{});
  out->al = al;
  out->valid = false;
  std::array<uint32_t, 256> next{};
  size_t high = size - 1;
  for (unsigned s = 0; s <= max_sym; ++s) {
    if (norm[s] == -1) {
      out->t[high--].sym = static_cast<uint8_t>(s);
      next[s] = 1;
    } else {
      next[s] = norm[s] > 0 ? static_cast<uint32_t>(norm[s]) : 0;
    }
  }
  size_t step = (size >> 1) + (size >> 3) + 3, mask = size - 1, pos = 0;
  for (unsigned s = 0; s <= max_sym; ++s) {
    for (int i = 0; i < norm[s]; ++i) {
      out->t[pos].sym = static_cast<uint8_t>(s);
      do pos = (pos + step) & mask;
      while (pos > high);
    }
  }
  if (pos != 0) return false;
  for (size_t u = 0; u < size; ++u) {
    uint32_t x = next[out->t[u].sym]++;
    if (x == 0) return false;
    unsigned nb = al - (31 - std::countl_zero(x));
    out->t[u].nb = static_cast<uint8_t>(nb);
    out->t[u].base = static_cast<uint16_t>((x << nb) - size);
  }
  out->valid = true;
  return true;
}

// "FSE Table Description": returns the bytes read, 0 when malformed.
size_t ReadFse(const uint8_t* p, size_t n, unsigned max_al, unsigned max_sym, FseTable* out) {
  FwdBits b{p, n};
  unsigned al = b.Read(4) + 5;
  if (al > max_al) return 0;
  std::array<int16_t, 256> norm{};
  int remaining = (1 << al) + 1, threshold = 1 << al, nb = static_cast<int>(al) + 1;
  unsigned sym = 0;
  bool previous0 = false;
  while (remaining > 1) {
    if (previous0) {
      for (;;) {
        uint32_t r = b.Read(2);
        sym += r;
        if (r != 3) break;
        if (sym > max_sym + 1 || b.overrun) return 0;
      }
    }
    if (sym > max_sym || b.overrun) return 0;
    int max = (2 * threshold - 1) - remaining;
    int count;
    if (static_cast<int>(b.Peek(nb - 1)) < max) {
      count = static_cast<int>(b.Read(nb - 1));
    } else {
      count = static_cast<int>(b.Read(nb));
      if (count >= threshold) count -= max;
    }
    --count;
    remaining -= count < 0 ? 1 : count;
    norm[sym++] = static_cast<int16_t>(count);
    previous0 = count == 0;
    while (remaining < threshold && threshold > 1) {
      --nb;
      threshold >>= 1;
    }
  }
  if (remaining != 1 || b.overrun) return 0;
  if (!BuildFse(norm.data(), sym - 1, al, out)) return 0;
  return (b.pos + 7) / 8;
}

constexpr std::array<uint32_t, 36> kLlBase = {0,  1,  2,  3,  4,  5,  6,   7,   8,   9,   10,   11,
                                              12, 13, 14, 15, 16, 18, 20,  22,  24,  28,  32,   40,
                                              48, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536};
constexpr std::array<uint8_t, 36> kLlBits = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  0,  0,  0,  1,  1,
                                             1, 1, 2, 2, 3, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
constexpr std::array<uint32_t, 53> kMlBase = {
    3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
    30, 31, 32, 33, 34, 35, 37, 39, 41, 43, 47, 51, 59, 67, 83, 99, 131, 259, 515, 1027, 2051, 4099, 8195, 16387,
    32771, 65539};
constexpr std::array<uint8_t, 53> kMlBits = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                             0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1,
                                             2, 2, 3, 3, 4, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
constexpr int16_t kLlDefault[36] = {4, 3, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 2, 2,
                                    2, 2, 2, 2, 2, 2, 2, 3, 2, 1, 1, 1, 1, 1, -1, -1, -1, -1};
constexpr int16_t kMlDefault[53] = {1, 4, 3, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,  1,  1,  1,  1,  1,  1,  1,  1,
                                    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1};
constexpr int16_t kOfDefault[29] = {1, 1, 1, 1, 1, 1, 2, 2, 2, 1, 1, 1, 1, 1, 1,
                                    1, 1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1};

struct HufEntry {
  uint8_t sym;
  uint8_t nb;
};

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
inline void PutLiterals(Output& out, const uint8_t* lit, size_t n) {
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

}  // namespace

struct SparseApplier::State {
  FseTable ll_default, ml_default, of_default;
  FseTable ll, ml, of;         // the tables of the last block with sequences ("Repeat_Mode")
  std::vector<HufEntry> huf;   // 1 << huf_bits entries; empty before the first Huffman block
  unsigned huf_bits = 0;
  std::vector<uint8_t> literals;
  uint32_t reps[3] = {1, 4, 8};

  State() {
    BuildFse(kLlDefault, 35, 6, &ll_default);
    BuildFse(kMlDefault, 52, 6, &ml_default);
    BuildFse(kOfDefault, 28, 5, &of_default);
    literals.resize(kBlockMax);
  }

  // "Huffman Tree Description": returns the bytes read, 0 when malformed.
  size_t ReadHuffmanTree(const uint8_t* p, size_t n) {
    if (n < 1) return 0;
    std::array<uint8_t, 256> w{};
    size_t count = 0, used = 0;
    if (p[0] >= 128) {
      count = p[0] - 127u;
      used = 1 + (count + 1) / 2;
      if (used > n) return 0;
      for (size_t i = 0; i < count; ++i) w[i] = (i % 2 == 0) ? p[1 + i / 2] >> 4 : p[1 + i / 2] & 15;
    } else {
      used = 1 + p[0];
      if (used > n || p[0] == 0) return 0;
      FseTable t;
      size_t h = ReadFse(p + 1, p[0], 6, 15, &t);
      if (h == 0 || h >= p[0]) return 0;
      BackBits b;
      if (!b.Init(p + 1 + h, p[0] - h)) return 0;
      uint32_t s1 = static_cast<uint32_t>(b.Read(t.al)), s2 = static_cast<uint32_t>(b.Read(t.al));
      if (b.remaining() < 0) return 0;
      for (;;) {  // two interleaved states until the stream runs out
        if (count + 2 > 255) return 0;
        w[count++] = t.t[s1].sym;
        s1 = t.t[s1].base + static_cast<uint32_t>(b.Read(t.t[s1].nb));
        if (b.remaining() < 0) {
          w[count++] = t.t[s2].sym;
          break;
        }
        w[count++] = t.t[s2].sym;
        s2 = t.t[s2].base + static_cast<uint32_t>(b.Read(t.t[s2].nb));
        if (b.remaining() < 0) {
          w[count++] = t.t[s1].sym;
          break;
        }
      }
    }
    uint32_t total = 0;
    for (size_t i = 0; i < count; ++i) {
      if (w[i] > 11) return 0;
      if (w[i]) total += 1u << (w[i] - 1);
    }
    if (total == 0 || count >= 256) return 0;
    unsigned bits = 32 - std::countl_zero(total);  // next power of two above total
    uint32_t rest = (1u << bits) - total;
    if (bits > 11 || !std::has_single_bit(rest)) return 0;
    w[count++] = static_cast<uint8_t>(std::countr_zero(rest) + 1);
    huf_bits = bits;
    huf.assign(size_t{1} << bits, HufEntry{0, 0});
    size_t start = 0;
    for (unsigned weight = 1; weight <= bits; ++weight) {
      for (size_t s = 0; s < count; ++s) {
        if (w[s] != weight) continue;
        size_t len = size_t{1} << (weight - 1);
        if (start + len > huf.size()) return 0;
        for (size_t k = 0; k < len; ++k) huf[start + k] = HufEntry{static_cast<uint8_t>(s), static_cast<uint8_t>(bits + 1 - weight)};
        start += len;
      }
    }
    return start == huf.size() ? used : 0;
  }

  bool DecodeHuffmanStream(const uint8_t* p, size_t n, uint8_t* out, size_t count) {
    BackBits b;
    if (!b.Init(p, n)) return false;
    for (size_t i = 0; i < count; ++i) {
      const HufEntry& e = huf[b.Peek(huf_bits)];
      out[i] = e.sym;
      b.Skip(e.nb);
    }
    return b.remaining() == 0;
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
      if (regen > kBlockMax) return 0;
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
    if (regen > kBlockMax || h + csize > n) return 0;
    const uint8_t* q = p + h;
    size_t qn = csize;
    if (type == 2) {
      size_t t = ReadHuffmanTree(q, qn);
      if (t == 0) return 0;
      q += t;
      qn -= t;
    } else if (huf.empty()) {
      return 0;  // treeless without a previous tree
    }
    *count = regen;
    if (sf == 0) {
      if (!DecodeHuffmanStream(q, qn, literals.data(), regen)) return 0;
    } else {
      if (qn < 10) return 0;
      size_t s1 = Le(q, 2), s2 = Le(q + 2, 2), s3 = Le(q + 4, 2);
      if (6 + s1 + s2 + s3 + 1 > qn) return 0;
      size_t s4 = qn - 6 - s1 - s2 - s3, per = (regen + 3) / 4;
      if (3 * per > regen) return 0;
      const uint8_t* s = q + 6;
      if (!DecodeHuffmanStream(s, s1, literals.data(), per) ||
          !DecodeHuffmanStream(s + s1, s2, literals.data() + per, per) ||
          !DecodeHuffmanStream(s + s1 + s2, s3, literals.data() + 2 * per, per) ||
          !DecodeHuffmanStream(s + s1 + s2 + s3, s4, literals.data() + 3 * per, regen - 3 * per)) {
        return 0;
      }
    }
    return h + csize;
  }

  // Reads one table of the "Sequences_Section_Header" into `table`.
  size_t ReadTable(unsigned mode, const uint8_t* p, size_t n, const FseTable& predefined, unsigned max_al,
                   unsigned max_sym, FseTable* table) {
    switch (mode) {
      case 0:
        *table = predefined;
        return 0;
      case 1:
        if (n < 1 || p[0] > max_sym) return SIZE_MAX;
        table->t.assign(1, FseEntry{0, 0, p[0]});
        table->al = 0;
        table->valid = true;
        return 1;
      case 2: {
        size_t used = ReadFse(p, n, max_al, max_sym, table);
        return used == 0 ? SIZE_MAX : used;
      }
      default:
        return table->valid ? 0 : SIZE_MAX;
    }
  }

  // "Sequences Section" and "Sequence Execution" in one loop: each sequence's literals
  // are XORed into `out` and its match is skipped when it provably copies zeros. False
  // when malformed or when a match may copy nonzero bytes (some literals may have been
  // applied by then: the caller undoes them by running the same frame again).
  bool ExecuteSequences(const uint8_t* p, size_t n, size_t nlit, Output& out) {
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
      if (h != n || nlit > out.size - out.pos) return false;
      PutLiterals(out, literals.data(), nlit);
      return true;
    }
    if (h >= n) return false;
    unsigned modes = p[h++];
    if (modes & 3) return false;
    size_t used;
    if ((used = ReadTable(modes >> 6, p + h, n - h, ll_default, 9, 35, &ll)) == SIZE_MAX) return false;
    h += used;
    if ((used = ReadTable((modes >> 4) & 3, p + h, n - h, of_default, 8, 31, &of)) == SIZE_MAX) return false;
    h += used;
    if ((used = ReadTable((modes >> 2) & 3, p + h, n - h, ml_default, 9, 52, &ml)) == SIZE_MAX) return false;
    h += used;
    BackBits b;
    if (h > n || !b.Init(p + h, n - h)) return false;
    uint32_t lls = static_cast<uint32_t>(b.Read(ll.al)), ofs = static_cast<uint32_t>(b.Read(of.al)),
             mls = static_cast<uint32_t>(b.Read(ml.al));
    size_t lp = 0;
    for (size_t i = 0; i < nseq; ++i) {
      unsigned ofc = of.t[ofs].sym, mlc = ml.t[mls].sym, llc = ll.t[lls].sym;
      if (ofc > 31 || mlc > 52 || llc > 35) return false;
      uint64_t ofv = (uint64_t{1} << ofc) + b.Read(ofc);
      uint32_t mlen = kMlBase[mlc] + static_cast<uint32_t>(b.Read(kMlBits[mlc]));
      uint32_t llen = kLlBase[llc] + static_cast<uint32_t>(b.Read(kLlBits[llc]));
      if (i + 1 < nseq) {
        lls = ll.t[lls].base + static_cast<uint32_t>(b.Read(ll.t[lls].nb));
        mls = ml.t[mls].base + static_cast<uint32_t>(b.Read(ml.t[mls].nb));
        ofs = of.t[ofs].base + static_cast<uint32_t>(b.Read(of.t[ofs].nb));
      }
      uint32_t offset;
      if (ofv > 3) {  // "Repeat offsets": a new offset
        offset = static_cast<uint32_t>(ofv - 3);
        reps[2] = reps[1];
        reps[1] = reps[0];
        reps[0] = offset;
      } else {
        unsigned idx = static_cast<unsigned>(ofv) - 1 + (llen == 0 ? 1 : 0);
        if (idx == 0) {
          offset = reps[0];
        } else {
          offset = idx == 3 ? reps[0] - 1 : reps[idx];
          if (offset == 0) return false;
          if (idx != 1) reps[2] = reps[1];
          reps[1] = reps[0];
          reps[0] = offset;
        }
      }
      if (llen > nlit - lp || llen > out.size - out.pos) return false;
      PutLiterals(out, literals.data() + lp, llen);
      lp += llen;
      if (offset > out.tz || mlen > out.size - out.pos) return false;  // may copy nonzero bytes
      out.pos += mlen;
      out.tz += mlen;
    }
    if (b.remaining() != 0 || nlit - lp > out.size - out.pos) return false;
    PutLiterals(out, literals.data() + lp, nlit - lp);
    return true;
  }
};

SparseApplier::SparseApplier() : state_(std::make_unique<State>()) {}
SparseApplier::~SparseApplier() = default;

bool SparseApplier::Apply(std::span<const uint8_t> frame, std::span<std::byte> region) {
  // Decoding never reads the region, so a second run of a failed frame XORs exactly the
  // same bytes again and leaves the region as it was.
  auto run = [&]() -> bool {
    State& st = *state_;
    st.reps[0] = 1;
    st.reps[1] = 4;
    st.reps[2] = 8;
    st.huf.clear();
    st.ll.valid = st.of.valid = st.ml.valid = false;
    const uint8_t* p = frame.data();
    size_t n = frame.size();
    if (n < 6 || Le(p, 4) != 0xFD2FB528u) return false;
    unsigned fhd = p[4];
    if (fhd & 0x08 || (fhd & 3) != 0) return false;  // reserved bit, dictionary
    bool single = fhd & 0x20, checksum = fhd & 0x04;
    unsigned fcs_flag = fhd >> 6;
    size_t fcs_bytes = fcs_flag == 0 ? (single ? 1 : 0) : size_t{1} << fcs_flag;
    size_t at = 5 + (single ? 0 : 1);
    if (at + fcs_bytes > n) return false;
    if (fcs_bytes > 0) {
      uint64_t fcs = 0;
      for (size_t i = 0; i < fcs_bytes; ++i) fcs |= uint64_t{p[at + i]} << (8 * i);
      if (fcs_bytes == 2) fcs += 256;
      if (fcs != region.size()) return false;
    }
    at += fcs_bytes;
    Output out{region.data(), region.size()};
    for (;;) {
      if (at + 3 > n) return false;
      uint32_t bh = Le(p + at, 3);
      at += 3;
      bool last = bh & 1;
      unsigned type = (bh >> 1) & 3;
      size_t size = bh >> 3;
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
        if (at + size > n || size > kBlockMax) return false;
        size_t nlit = 0, lsize = st.ReadLiterals(p + at, size, &nlit);
        if (lsize == 0 || !st.ExecuteSequences(p + at + lsize, size - lsize, nlit, out)) return false;
        at += size;
      } else {
        return false;
      }
      if (last) break;
    }
    if (checksum) at += 4;
    return at == n && out.pos == out.size;
  };
  if (run()) return true;
  (void)run();
  return false;
}

}  // namespace wsync::delta
