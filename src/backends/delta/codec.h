// DeltaCodec: the two hot loops of the `delta` backend, one tensor at a time.
//
// Encode() turns (new bytes, snapshot bytes) into the checksum of the new bytes and one
// zstd frame of their byte-wise XOR against the snapshot, and leaves the snapshot equal
// to the new bytes. Apply() is its inverse on the receiver: it streams one frame out of
// zstd, XORs it into a tensor's bytes in place and checks the checksum of the result.
// The wire form is SkyRL's (reference/skyrl_weight_sync.md §5.1): a dense XOR patch as
// ONE standard zstd frame with its content size, and the xxh3-128 (or sha256) hex digest
// of the full new bytes, so either side can read what the other wrote.
//
// The frame is written by zstd::FrameWriter (zstd_writer.h), the backend's one encoder,
// without libzstd: each zero run becomes a literal zero plus an offset-1 match, literals
// are Huffman-coded and the lengths FSE-coded with tables written once per frame (once
// per part for a tensor encoded in parts on several threads: EncodePart). On bf16
// RL-step patches that is faster than libzstd at level 1, from the same sequences or
// from its own match finder, and gives a smaller frame (`delta_codec_benchmark`, which
// keeps the libzstd encoder as its baseline; docs/benchmarks.md, "delta"); any zstd
// decoder reads it.
//
// Apply() first tries SparseApplier (apply/sparse_apply.h), which XORs only the frame's
// literals into the tensor (its matches copy zeros, so they change nothing), then hashes
// the tensor; frames of any other shape go through libzstd's streaming decoder.
//
// Both run in one pass over memory, in blocks of `block_bytes` that stay in cache:
// hash, XOR, snapshot update and compression of a block happen before the next block is
// touched, instead of one full pass per step. Encode() starts the zstd frame only at the
// first changed block (leading zero blocks are fed from a static zero page), so an
// unchanged tensor costs a read and a compare, never a compression.
//
// A DeltaCodec holds one frame writer and one zstd decompression context; it is not
// thread-safe. Use one per thread (the publisher and the apply pool keep one each).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backends/delta/apply/sparse_apply.h"
#include "backends/delta/zstd_writer.h"
#include "core/digest.h"
#include "wsync/status.h"

namespace wsync::delta {

// Bytes per fused step: new + snapshot + patch of one block must fit in L2.
inline constexpr size_t kDefaultBlockBytes = size_t{64} << 10;
// The largest block: one zstd block (Block_Maximum_Size).
inline constexpr size_t kMaxBlockBytes = size_t{128} << 10;

struct EncodedDelta {
  bool changed = false;             // false: the patch is all zeros and `compressed` is empty
  uint64_t changed_bytes = 0;       // nonzero bytes of the patch
  std::vector<uint8_t> compressed;  // one zstd frame (content size set) when changed
  std::string checksum;             // lowercase hex digest of the new bytes
  std::string previous_checksum;    // of the snapshot's bytes before the call, when asked for
};

// What Encode() does besides the patch and the checksum of the new bytes.
struct EncodeOptions {
  // Also digest the snapshot's bytes as they are read, before they are overwritten
  // (previous_checksum), so that the caller can check what it XORed against.
  bool hash_previous = false;
  // Called on the encoding thread after each block with the bytes of the snapshot done
  // so far (ascending; the last call has the whole size): the pass never touches bytes
  // below that again, so a caller can drop their pages (the publisher's state file).
  std::function<void(size_t done)> after_block;
};

// One part of a tensor's frame (DeltaCodec::EncodePart): its zstd blocks, no header.
struct EncodedPart {
  uint64_t changed_bytes = 0;   // nonzero bytes of the part's patch
  std::vector<uint8_t> blocks;  // every byte of the part, unchanged runs as RLE blocks
  // xxh3-128 hex of the part's new bytes and of its snapshot bytes before the call, when
  // asked for.
  std::string checksum, previous_checksum;
};

class DeltaCodec {
 public:
  // `sparse_apply` false makes Apply() use libzstd for every frame (tests, benchmarks).
  // `block_bytes` in (0, kMaxBlockBytes].
  static Result<std::unique_ptr<DeltaCodec>> Create(size_t block_bytes = kDefaultBlockBytes,
                                                    bool sparse_apply = true);
  ~DeltaCodec();
  DeltaCodec(const DeltaCodec&) = delete;
  DeltaCodec& operator=(const DeltaCodec&) = delete;

  // `next` and `snapshot` must have the same size (InvalidArgument otherwise); then
  // snapshot == next on return.
  Result<EncodedDelta> Encode(std::span<const std::byte> next, std::span<std::byte> snapshot,
                              DigestAlgorithm algorithm, const EncodeOptions& options = {});

  // A large tensor on several threads: Encode() of bytes [a, b) of it as a run of zstd
  // blocks with fresh tables (zstd::FrameWriter::BeginPart), no header and no checksum
  // (the caller hashes the whole tensor). `last`: the part ends the tensor. Parts of
  // fixed boundaries give the same frame whichever threads encode them. On return the
  // part's snapshot equals `next`. `digests`: also the part's checksum and
  // previous_checksum (xxh3-128), as Encode()'s hash_previous.
  EncodedPart EncodePart(std::span<const std::byte> next, std::span<std::byte> snapshot, bool last,
                         bool digests = false);
  // One frame of `content_size` bytes from a tensor's parts, in order; empty when no
  // part changed (the tensor is unchanged and has no frame, as with Encode()).
  static std::vector<uint8_t> JoinParts(uint64_t content_size, std::span<const EncodedPart> parts);

  // region ^= decompress(frame), then checks the digest of the result against
  // `expected_hex` (an empty one skips the check: the publisher's rollback). DataLoss for
  // a corrupt or truncated frame, a frame whose size is not region.size(), or a digest
  // mismatch; `what` names the tensor. The region is modified even when the check fails.
  Status Apply(std::span<const uint8_t> frame, std::span<std::byte> region,
               DigestAlgorithm algorithm, std::string_view expected_hex, std::string_view what);

  // Frames Apply() took through SparseApplier (touching only changed bytes) and through
  // libzstd (any other valid frame, e.g. one SkyRL's publisher wrote).
  uint64_t sparse_frames() const { return sparse_frames_; }
  uint64_t libzstd_frames() const { return libzstd_frames_; }

 private:
  DeltaCodec() = default;
  // The block loop of Encode() (and of EncodePart() when `part`): XOR, snapshot update,
  // `hasher` (new bytes) and `previous` (snapshot bytes before the update) when given,
  // and blocks into frame_, calling `after_block` (when set) after each; returns the
  // bytes written there.
  size_t WriteBlocks(zstd::FrameWriter& writer, std::span<const std::byte> next, std::span<std::byte> snapshot,
                     Hasher* hasher, Hasher* previous, bool part, bool ends_frame, uint64_t* changed_bytes,
                     const std::function<void(size_t)>* after_block = nullptr);
  struct Zstd;
  std::unique_ptr<Zstd> zstd_;
  zstd::FrameWriter writer_;
  std::vector<uint8_t> frame_;    // the frame being written (kept between tensors)
  std::vector<uint64_t> masks_;   // nonzero bytes of block_, one word per 64 bytes
  size_t block_bytes_ = kDefaultBlockBytes;
  std::vector<std::byte> block_;  // one patch block (and slack the frame writer reads)
  std::unique_ptr<SparseApplier> sparse_;
  uint64_t sparse_frames_ = 0;
  uint64_t libzstd_frames_ = 0;
};

// XORs `src` into `dst` (dst ^= src), the inner loop of Apply(); exposed for tests.
void XorInto(std::span<std::byte> dst, std::span<const std::byte> src);

// patch = next ^ snap and snap = next over n bytes; returns the nonzero bytes of patch.
// The portable form of Encode()'s first step (which uses AVX2 where it can); exposed for
// the benchmark's libzstd baseline.
uint64_t XorUpdate(const std::byte* next, std::byte* snap, std::byte* patch, size_t n);

}  // namespace wsync::delta
