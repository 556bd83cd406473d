#include "backends/delta/apply/zstd_decode.h"

#include <algorithm>

namespace wsync::delta::zstd {

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

size_t HuffmanTable::Read(const uint8_t* p, size_t n) {
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
  bits_ = bits;
  table_.assign(size_t{1} << bits, HufEntry{0, 0});
  size_t start = 0;
  for (unsigned weight = 1; weight <= bits; ++weight) {
    for (size_t s = 0; s < count; ++s) {
      if (w[s] != weight) continue;
      size_t len = size_t{1} << (weight - 1);
      if (start + len > table_.size()) return 0;
      for (size_t k = 0; k < len; ++k) table_[start + k] = HufEntry{static_cast<uint8_t>(s), static_cast<uint8_t>(bits + 1 - weight)};
      start += len;
    }
  }
  if (start != table_.size()) return 0;
  // A second symbol follows in the same lookup when its code fits in the bits left:
  // those bits are the top of the index the rest of `i` (shifted up) makes.
  pairs_.resize(table_.size());
  const size_t mask = table_.size() - 1;
  for (size_t i = 0; i < table_.size(); ++i) {
    const HufEntry a = table_[i];
    const HufEntry b = table_[(i << a.nb) & mask];
    pairs_[i] = a.nb + b.nb <= bits ? HufPair{{a.sym, b.sym}, static_cast<uint8_t>(a.nb + b.nb), 2}
                                    : HufPair{{a.sym, 0}, a.nb, 1};
  }
  return used;
}

bool HuffmanTable::DecodeStream(const uint8_t* p, size_t n, uint8_t* out, size_t count) const {
  BackBits b;
  if (!b.Init(p, n)) return false;
  for (size_t i = 0; i < count; ++i) {
    const HufEntry& e = table_[b.Peek(bits_)];
    out[i] = e.sym;
    b.Skip(e.nb);
  }
  return b.remaining() == 0;
}

namespace {

__attribute__((always_inline)) inline bool DecodeFourStreamsBody(const HufEntry* t, const HufPair* t2, unsigned bits,
                                                                const uint8_t* p, size_t n, uint8_t* out,
                                                                size_t count) {
  if (n < 10) return false;
  size_t s1 = Le(p, 2), s2 = Le(p + 2, 2), s3 = Le(p + 4, 2);
  if (6 + s1 + s2 + s3 + 1 > n) return false;
  size_t s4 = n - 6 - s1 - s2 - s3, per = (count + 3) / 4;
  if (3 * per > count) return false;
  const uint8_t* s = p + 6;
  BackBits b[4];
  if (!b[0].Init(s, s1) || !b[1].Init(s + s1, s2) || !b[2].Init(s + s1 + s2, s3) ||
      !b[3].Init(s + s1 + s2 + s3, s4)) {
    return false;
  }
  uint8_t* o[4] = {out, out + per, out + 2 * per, out + 3 * per};
  uint8_t* const end[4] = {out + per, out + 2 * per, out + 3 * per, out + count};
  // Five lookups per stream write at most ten symbols; the streams advance unevenly, so
  // the closest to its end decides (a store of two symbols past it would clobber the
  // next stream's first, decoded already).
  auto room = [&] {
    return std::min(std::min(end[0] - o[0], end[1] - o[1]), std::min(end[2] - o[2], end[3] - o[3]));
  };
  while (room() >= 10) {
    if (!(b[0].RefillFast() & b[1].RefillFast() & b[2].RefillFast() & b[3].RefillFast())) break;
    for (int r = 0; r < 5; ++r) {  // 5 x 11 bits <= 57
      for (int k = 0; k < 4; ++k) {
        HufPair e = t2[b[k].PeekUnchecked(bits)];
        std::memcpy(o[k], e.sym, 2);
        o[k] += e.count;
        b[k].Skip(e.nb);
      }
    }
  }
  for (int k = 0; k < 4; ++k) {
    while (o[k] < end[k]) {
      HufEntry e = t[b[k].Peek(bits)];
      *o[k]++ = e.sym;
      b[k].Skip(e.nb);
    }
    if (b[k].remaining() != 0) return false;
  }
  return true;
}

__attribute__((noinline)) bool DecodeFourStreamsBaseline(const HufEntry* t, const HufPair* t2, unsigned bits,
                                                         const uint8_t* p, size_t n, uint8_t* out, size_t count) {
  return DecodeFourStreamsBody(t, t2, bits, p, n, out, count);
}
#if defined(__x86_64__)
// BMI2's three-operand shifts leave the cl register out of the four streams' peeks.
__attribute__((noinline, target("bmi,bmi2"))) bool DecodeFourStreamsBmi2(const HufEntry* t, const HufPair* t2,
                                                                         unsigned bits, const uint8_t* p, size_t n,
                                                                         uint8_t* out, size_t count) {
  return DecodeFourStreamsBody(t, t2, bits, p, n, out, count);
}
#endif

}  // namespace

namespace {
#if defined(__x86_64__)
IsaChoice bmi2(__builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2"));
#else
IsaChoice bmi2(false);
#endif
}  // namespace

bool CpuHasBmi2() { return bmi2.enabled(); }
void UseBaselineDecodeForTesting(bool baseline) { bmi2.UseBaseline(baseline); }

bool HuffmanTable::DecodeFourStreams(const uint8_t* p, size_t n, uint8_t* out, size_t count) const {
#if defined(__x86_64__)
  if (CpuHasBmi2()) return DecodeFourStreamsBmi2(table_.data(), pairs_.data(), bits_, p, n, out, count);
#endif
  return DecodeFourStreamsBaseline(table_.data(), pairs_.data(), bits_, p, n, out, count);
}

}  // namespace wsync::delta::zstd
