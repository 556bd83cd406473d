// SparseApplier: applies one zstd-framed XOR patch to a tensor by touching only the
// patch's literal bytes, for frames whose matches provably copy zeros.
//
// A delta patch is mostly zeros. The frames DeltaCodec writes encode each zero run as
// a literal zero followed by an offset-1 match, which a generic decoder must expand byte
// by byte (slowly: docs/benchmarks.md, "delta", times libzstd on them). XOR with zero
// changes nothing, so this decoder parses the frame (RFC 8878: frame and block headers, Huffman
// literals, FSE-coded sequences, repeat offsets), XORs the literals into the tensor at
// their positions and skips every match whose source lies inside the run of zeros that
// ends at the current position. The caller then hashes the tensor to verify it.
//
// Anything outside that shape (a match that may copy nonzero bytes, a dictionary, a
// content checksum, a window over 2^27 bytes, a malformed or truncated frame, one that
// breaks a limit of the format such as a block over Block_Maximum_Size, a size that
// disagrees with the tensor) makes Apply() return false with the tensor exactly as it
// was, and the caller falls back to libzstd, which decodes every valid frame and reports
// every invalid one. So it accepts no frame libzstd refuses (delta_sparse_apply_fuzz
// checks this against libzstd, differentially). (Decoding never reads
// the tensor, so running a failed frame a second time XORs the same bytes back.)
//
// SparseApplier is the entry point of apply/ (library wsync_delta_apply), the backend's
// patch reader: it and the entropy decoding it uses (zstd_decode.h) depend on nothing of
// the encoder (../codec.h, ../zstd_writer.h) but the format's constants (../zstd_format.h).
//
// Not thread-safe: one per thread (it keeps scratch buffers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "core/digest.h"

namespace wsync::delta {

class SparseApplier {
 public:
  SparseApplier();
  ~SparseApplier();
  SparseApplier(const SparseApplier&) = delete;
  SparseApplier& operator=(const SparseApplier&) = delete;

  // region ^= patch(frame) when the frame has the sparse shape; false (region unchanged)
  // otherwise. With a hasher, each stretch of the region is hashed right after it is
  // patched, while it is still in cache (one pass over memory instead of two); after a
  // false return the hasher's state is meaningless.
  bool Apply(std::span<const uint8_t> frame, std::span<std::byte> region, Hasher* hasher = nullptr);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace wsync::delta
