// The decoding half of zstd's entropy coding (RFC 8878), what SparseApplier reads a frame
// with: backward bitstreams, FSE decoding tables (built from a normalized distribution or
// read from an "FSE Table Description"), and Huffman decoding tables and streams. The
// format's fixed code tables, which the frame writer uses too, are in zstd_format.h.
//
// Every function is bounds-checked against its input and reports malformed data by its
// return value (0 bytes read, false), never by reading outside the buffer. Pure or
// operating on caller-owned tables; safe from any thread on distinct objects.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backends/delta/zstd_format.h"

namespace wsync::delta::zstd {

inline uint32_t Le(const uint8_t* p, int n) {
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
  // Refills, then says whether at least 57 bits are held (the stream's start is not
  // near), i.e. whether Unchecked reads of up to 57 bits in all are safe until the
  // next refill. False near the start: use Read() there.
  bool RefillFast() {
    if (ptr_ - start_ >= static_cast<std::ptrdiff_t>(8 + (consumed_ >> 3))) {  // far from the start: no checks
      ptr_ -= consumed_ >> 3;
      consumed_ &= 7;
      std::memcpy(&container_, ptr_, 8);
      return true;
    }
    Refill();
    return consumed_ <= 7;
  }
  // n in [0, 57 - bits read since RefillFast() returned true].
  uint64_t ReadUnchecked(unsigned n) {
    uint64_t v = ((container_ << consumed_) >> 1) >> (63 - n);
    consumed_ += n;
    return v;
  }
  // n in [1, 57 - bits read since RefillFast() returned true].
  uint64_t PeekUnchecked(unsigned n) const { return (container_ << consumed_) >> (64 - n); }
  // Whether a refill cannot reach the stream's start (8+ bytes left before the
  // container): then RefillUnchecked() is safe.
  bool FarFromStart() const { return ptr_ - start_ >= 8; }
  // Refills to 57+ bits without looking at the start; only when FarFromStart().
  void RefillUnchecked() {
    ptr_ -= consumed_ >> 3;
    consumed_ &= 7;
    std::memcpy(&container_, ptr_, 8);
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

// Whether the CPU has BMI1 and BMI2 (x86-64), for the decoding loops that have a clone
// compiled for them: three-operand shifts keep their variable shifts off the cl register.
// False after UseBaselineDecodeForTesting(true), so that tests run the baseline clones.
bool CpuHasBmi2();
void UseBaselineDecodeForTesting(bool baseline);  // not thread-safe against decoders

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

// "From normalized distribution to decoding tables": false when the counts do not fill
// the table exactly.
bool BuildFse(const int16_t* norm, unsigned max_sym, unsigned al, FseTable* out);

// "FSE Table Description": returns the bytes read, 0 when malformed (accuracy log above
// max_al, a symbol above max_sym, counts that do not add up, input too short).
size_t ReadFse(const uint8_t* p, size_t n, unsigned max_al, unsigned max_sym, FseTable* out);

// The predefined distributions of literal lengths, match lengths and offset codes.
inline constexpr int16_t kLlDefault[36] = {4, 3, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 2, 2,
                                    2, 2, 2, 2, 2, 2, 2, 3, 2, 1, 1, 1, 1, 1, -1, -1, -1, -1};
inline constexpr int16_t kMlDefault[53] = {1, 4, 3, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,  1,  1,  1,  1,  1,  1,  1,  1,
                                    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1};
inline constexpr int16_t kOfDefault[29] = {1, 1, 1, 1, 1, 1, 2, 2, 2, 1, 1, 1, 1, 1, 1,
                                    1, 1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1};

// A Huffman decoding table: 1 << bits entries, indexed by the next `bits` bits.
struct HufEntry {
  uint8_t sym;
  uint8_t nb;
};

// The same index, decoding up to two symbols at once: `sym[0]`, then `sym[1]` when
// `count` is 2 (both codes fit in the `bits` bits looked up); `nb` is the bits they
// take together.
struct HufPair {
  uint8_t sym[2];
  uint8_t nb;
  uint8_t count;
};

class HuffmanTable {
 public:
  bool empty() const { return table_.empty(); }
  void clear() {
    table_.clear();
    pairs_.clear();
  }
  // "Huffman Tree Description": returns the bytes read, 0 when malformed.
  size_t Read(const uint8_t* p, size_t n);
  // Decodes `count` symbols of one "Huffman-coded Stream"; false unless the stream is
  // consumed exactly.
  bool DecodeStream(const uint8_t* p, size_t n, uint8_t* out, size_t count) const;
  // Decodes `count` symbols of four streams (the "4 streams" literals layout) that are
  // `n` bytes at p, jump table included; interleaved, five lookups of one or two
  // symbols per stream between refills. False unless each stream is consumed exactly.
  // `out` must have 2 bytes of room past `count` (a lookup stores two symbols).
  bool DecodeFourStreams(const uint8_t* p, size_t n, uint8_t* out, size_t count) const;
  // Code length of every byte value (0: no code), as read.
  std::array<uint8_t, 256> CodeLengths() const {
    std::array<uint8_t, 256> len{};
    for (const HufEntry& e : table_) len[e.sym] = e.nb;
    return len;
  }

 private:
  std::vector<HufEntry> table_;
  std::vector<HufPair> pairs_;  // built with table_
  unsigned bits_ = 0;
};

}  // namespace wsync::delta::zstd
