// LibzstdEncoder: DeltaCodec::Encode's patch written by libzstd instead of
// zstd::FrameWriter, the baseline `delta_codec_benchmark` measures the product's encoder
// against. Only the benchmark links it; the product has one encoder (codec.h).
//
// It runs the same fused pass as Encode() (hash, XOR, snapshot update, one block at a
// time) and hands each block to libzstd's streaming compressor at `level`, with a
// sequence producer that makes the same sequences FrameWriter does: every zero run of four
// or more bytes is one literal zero and a match at offset 1. libzstd then codes them with
// its own entropy stage. The frame is a standard one with its content size, so
// DeltaCodec::Apply reads it.
//
// Not thread-safe: one per thread (it holds a compression context).
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "backends/delta/codec.h"
#include "core/digest.h"
#include "wsync/status.h"

namespace wsync::delta {

class LibzstdEncoder {
 public:
  // `level`: a zstd compression level (SkyRL's is 1); `block_bytes` in (0, kMaxBlockBytes].
  static Result<std::unique_ptr<LibzstdEncoder>> Create(int level = 1, size_t block_bytes = kDefaultBlockBytes);
  ~LibzstdEncoder();
  LibzstdEncoder(const LibzstdEncoder&) = delete;
  LibzstdEncoder& operator=(const LibzstdEncoder&) = delete;

  // As DeltaCodec::Encode without options: on success snapshot == next. Internal for a
  // zstd failure (the snapshot may then be partly updated).
  Result<EncodedDelta> Encode(std::span<const std::byte> next, std::span<std::byte> snapshot,
                              DigestAlgorithm algorithm);

 private:
  LibzstdEncoder() = default;
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
  size_t block_bytes_ = kDefaultBlockBytes;
  std::vector<std::byte> block_;  // one patch block
};

}  // namespace wsync::delta
