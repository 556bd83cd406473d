// Packing: how an ordered tensor list is cut into chunks, for every packed data plane.
//
// Both sides of a transfer walk the same list and cut it the same way. CutChunks has two
// rules:
// - kCloseAfterOverflow, vLLM's packed NCCL producer (packed_tensor.py), which PlanChunks
//   reproduces exactly: a tensor is appended to the current chunk, and AFTER appending,
//   if the chunk's running size is strictly greater than the limit, the chunk is closed.
//   A chunk may therefore exceed the limit by up to one tensor, and a single oversized
//   tensor forms its own chunk. A chunk on the wire is the raw bytes of its tensors
//   concatenated, with no alignment, padding or header.
// - kCloseBeforeOverflow, vLLM's IPC producer (the ipc backend's fixed slots): a chunk is
//   closed BEFORE the tensor that would take it past the limit, so no chunk exceeds it; a
//   tensor larger than the limit is an error.
// Either way the last partial chunk is flushed at the end, and tensors start at
// multiples of `alignment` inside their chunk (padding counts in the chunk's bytes).
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES and DEFAULT_PACKED_NUM_BUFFERS.
inline constexpr size_t kDefaultPackedBufferBytes = size_t{1} << 30;
inline constexpr int kDefaultPackedNumBuffers = 2;

struct Chunk {
  size_t first = 0;  // index of the chunk's first tensor
  size_t end = 0;    // one past its last tensor
  size_t bytes = 0;  // total bytes of its tensors
};

struct ChunkPlan {
  std::vector<Chunk> chunks;
  // Byte offset of every tensor inside its chunk, indexed like the tensor list.
  std::vector<size_t> offset_in_chunk;
  size_t max_chunk_bytes = 0;
  size_t total_bytes = 0;
};

struct ChunkCut {
  enum class Rule { kCloseAfterOverflow, kCloseBeforeOverflow };
  Rule rule = Rule::kCloseAfterOverflow;
  size_t limit = 0;      // bytes of the buffer or slot a chunk goes into (> 0)
  size_t alignment = 1;  // every tensor's offset inside its chunk is a multiple of this (> 0)
  // The buffer as errors name it ("the ipc staging slot").
  std::string_view limit_name = "the packed buffer";
};

// Cuts `tensors` by `cut`. InvalidArgument for a zero limit or alignment, and, under
// kCloseBeforeOverflow, naming the first tensor larger than the limit.
Result<ChunkPlan> CutChunks(std::span<const TensorMeta> tensors, const ChunkCut& cut);

// vLLM's packed cut (kCloseAfterOverflow, no alignment) for a buffer of
// `buffer_size_bytes` (> 0).
Result<ChunkPlan> PlanChunks(std::span<const TensorMeta> tensors, size_t buffer_size_bytes);

// The trainer's packed buffer size: max(bucket_bytes, largest tensor), as SkyRL sizes it,
// so that no single tensor overflows a buffer.
size_t PackedBufferSize(std::span<const TensorMeta> tensors, size_t bucket_bytes);

}  // namespace wsync
