// FrameWriter: writes one standard zstd frame (RFC 8878) of a sparse XOR patch directly,
// block by block, without libzstd. DeltaCodec::Encode uses it.
//
// A patch is runs of zeros between isolated changed bytes. Each zero run of four or more
// bytes becomes one sequence: its changed bytes and one zero as literals, then a match of
// the rest of the run at offset 1 (repeat offset 1: the byte just written, a zero).
// Because every sequence has literals and the offset never changes, the offset code is
// always 0 (RLE mode, no bits); literal and match lengths are FSE-coded with tables
// built once per frame from the first block with enough sequences (every symbol kept
// codable, so later blocks reuse them in Repeat mode), and literals are Huffman-coded
// with one tree per frame (later blocks are "treeless"). A block whose encoding would
// not be smaller than itself is written raw; an all-zero block as an RLE block. Any
// zstd decoder (libzstd, the `zstd` CLI) reads the frame; SparseApplier reads it fastest.
//
// The tables are rebuilt (and written again) when a later block has many more
// sequences or literals than the one they were built from, so a tensor whose first
// changed block is nearly empty still gets tables that fit the rest. A frame may also be
// written in parts by several writers (BeginPart), each part with tables of its own.
//
// Not thread-safe: one per thread; it keeps scratch buffers between frames.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backends/delta/prefetch.h"

namespace wsync::delta::zstd {

// Largest block the format allows (Block_Maximum_Size with a window of 128 KiB).
inline constexpr size_t kMaxBlock = size_t{128} << 10;

// Forward writer of a bitstream that zstd reads backward: bits are appended LSB-first
// and the reader's Read(n) returns exactly what Add(v, n) wrote. Flush() after at most
// 56 bits; the buffer needs 8 bytes of slack past the end of what is written.
class BitWriter {
 public:
  explicit BitWriter(uint8_t* p) : start_(p), p_(p) {}
  // v < 2^n (callers mask), bits held + n <= 64.
  void Add(uint64_t v, unsigned n) {
    c_ |= v << bits_;
    bits_ += n;
  }
  void Flush() {
    std::memcpy(p_, &c_, 8);
    unsigned bytes = bits_ >> 3;
    p_ += bytes;
    bits_ &= 7;
    c_ = bytes == 8 ? 0 : c_ >> (8 * bytes);
  }
  // Appends the end marker (a 1 bit) and returns the stream's size in bytes.
  size_t Close() {
    Add(1, 1);
    Flush();
    return static_cast<size_t>(p_ - start_) + (bits_ > 0 ? 1 : 0);
  }

 private:
  uint8_t* start_;
  uint8_t* p_;
  uint64_t c_ = 0;
  unsigned bits_ = 0;
};

// FSE encoding table (libzstd's FSE_buildCTable scheme, the exact inverse of the
// decoding table SparseApplier and libzstd build from the same normalized counts).
struct FseCTable {
  struct Sym {
    int32_t find_state = 0;
    uint32_t delta_nb = 0;
  };
  unsigned al = 0;
  std::vector<uint16_t> next;
  std::array<Sym, 256> sym{};
};

// `norm` as in an FSE table description (-1: "less than 1"), summing to 2^al.
void BuildFseCTable(const int16_t* norm, unsigned max_sym, unsigned al, FseCTable* out);

struct FseState {
  uint32_t value = 0;
  void Init(const FseCTable& t, unsigned s) {
    const FseCTable::Sym& e = t.sym[s];
    uint32_t nb = (e.delta_nb + (1u << 15)) >> 16;
    uint32_t v = (nb << 16) - e.delta_nb;
    value = t.next[(v >> nb) + e.find_state];
  }
  void Encode(BitWriter& w, const FseCTable& t, unsigned s) {
    const FseCTable::Sym& e = t.sym[s];
    uint32_t nb = (value + e.delta_nb) >> 16;
    w.Add(value & ((1u << nb) - 1), nb);
    value = t.next[(value >> nb) + e.find_state];
  }
  void Finish(BitWriter& w, const FseCTable& t) const { w.Add(value & ((1u << t.al) - 1), t.al); }
};

// Normalizes `counts` (symbols 0..max_sym, some nonzero) to 2^al, every present symbol
// at least 1. False when there are more present symbols than 2^al.
bool NormalizeCounts(const uint32_t* counts, unsigned max_sym, unsigned al, int16_t* norm);

// "FSE Table Description" of `norm` (symbols 0..max_sym, the last one nonzero); returns
// the bytes written (at most 2 + (max_sym + 1) * 2).
size_t WriteFseTable(const int16_t* norm, unsigned max_sym, unsigned al, uint8_t* out);

// A Huffman code for literal bytes: lengths at most 11 bits, canonical in zstd's order,
// and the "Huffman Tree Description" that a decoder rebuilds the same code from.
struct HufCTable {
  std::array<uint16_t, 256> code{};
  std::array<uint8_t, 256> len{};
  std::vector<uint8_t> description;
};

// Builds a code for `counts` (every symbol in 0..255 with a nonzero count gets one);
// false when no valid description exists (fewer than two symbols, or weights that do
// not compress below 128 bytes).
bool BuildHuffman(const uint32_t* counts, HufCTable* out);

// Makes every FrameWriter use (true) or stop using the baseline x86-64 scan instead of
// the AVX2 one on CPUs that have AVX2, and SparseApplier its baseline decoding loops
// instead of the BMI2 ones (tests; not thread-safe against running writers).
void UseBaselineIsaForTesting(bool baseline);
// Whether the AVX2 loops run (the CPU has AVX2, BMI1/2 and POPCNT, and no test said no).
bool Avx2Enabled();

class FrameWriter {
 public:
  FrameWriter();
  // Starts a frame of `content_size` bytes, appended to `out` from `*used` on (`out` is
  // grown as needed; `*used` advances).
  void Begin(uint64_t content_size, std::vector<uint8_t>* out, size_t* used);
  // Starts a run of blocks that continues a frame begun elsewhere: no header, and fresh
  // tables (the first block that needs a code writes its own, as the first block of a
  // frame does). Runs written this way, on several threads, concatenated after one
  // WriteFrameHeader() make one standard frame: the only state a decoder carries from
  // block to block is the last tables and the repeat offsets, and these blocks never
  // change repeat offset 1 (see above).
  void BeginPart(std::vector<uint8_t>* out, size_t* used);
  // The header Begin() writes for a frame of `content_size` bytes into `out` (room for
  // kMaxFrameHeader bytes); returns its size.
  static size_t WriteFrameHeader(uint64_t content_size, uint8_t* out);
  static constexpr size_t kMaxFrameHeader = 14;
  // Appends `n` (<= kMaxBlock) bytes of the patch as one block. `patch` must be
  // readable for 32 bytes past n (the scan reads whole words). `last` ends the frame.
  // `masks`, when given, has bit i of word k set iff patch[64k + i] != 0 (for every
  // chunk, the partial last one too; the caller computed them while XORing). `ahead`:
  // memory to pull into cache meanwhile (prefetch.h); the frame does not depend on it.
  void AddBlock(const uint8_t* patch, size_t n, bool last, const uint64_t* masks = nullptr, Prefetch ahead = {});
  // Appends `n` zero bytes (any size) as RLE blocks.
  void AddZeros(uint64_t n, bool last);
  // The whole frame of an all-zero patch of `content_size` bytes (header and RLE blocks:
  // 4 bytes per kMaxBlock), which leaves a tensor as it is.
  static std::vector<uint8_t> ZeroFrame(uint64_t content_size);

 private:
  struct Seq {
    uint32_t ll;
    uint32_t ml;
  };
  uint8_t* Reserve(size_t n);
  static void PutBlockHeader(uint8_t* p, bool last, unsigned type, size_t size);
  // Fill seqs_, lits_ and return the literal count.
  size_t Scan(const uint8_t* patch, size_t n, const uint64_t* masks, Prefetch& ahead);
  size_t WriteLiterals(const uint8_t* lit, size_t n, uint8_t* out);
  size_t WriteSequences(uint8_t* out, Prefetch& ahead);

  std::vector<uint8_t>* out_ = nullptr;
  size_t* used_ = nullptr;
  std::vector<Seq> seqs_;
  std::vector<uint8_t> lits_;
  std::vector<uint8_t> scratch_;  // one compressed block
  std::vector<uint8_t> ll_code_, ml_code_;  // codes of seqs_
  std::vector<uint32_t> pos_;               // positions of the changed bytes of a block
  // Per frame: the literal code and the sequence tables the last blocks used.
  HufCTable huf_, huf_next_;  // next: built for the current block, kept if it is written
  bool fresh_huf_ = false;     // the current block's literals carry huf_next_
  bool fresh_seq_ = false;     // the current block's sequences carry ll_next_, ml_next_
  size_t seqs_count_ = 0;      // sequences in seqs_ for the current block
  bool huf_valid_ = false;   // huf_ was written in an earlier block of this frame
  bool huf_failed_ = false;  // no code fits: literals stay raw
  size_t huf_from_ = 0;      // literals the code was built from
  FseCTable ll_, ml_, ll_next_, ml_next_;
  bool seq_valid_ = false;
  size_t seq_from_ = 0;  // sequences the tables were built from
  std::array<int16_t, 36> ll_norm_{};
  std::array<int16_t, 53> ml_norm_{};
};

}  // namespace wsync::delta::zstd
