// Packing: how tensors are cut into chunks for the packed data plane.
//
// Reproduces vLLM's packed producer exactly (packed_tensor.py): both sides walk the same
// ordered tensor list; a tensor is appended to the current chunk, and AFTER appending,
// if the chunk's running size is strictly greater than the buffer size, the chunk is
// closed. A chunk may therefore exceed the buffer size by up to one tensor, and a single
// oversized tensor forms its own chunk. The last partial chunk is flushed at the end. A
// chunk on the wire is the raw bytes of its tensors concatenated, with no alignment,
// padding or header. Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
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

// Cuts `tensors` into chunks for a buffer of `buffer_size_bytes` (> 0).
Result<ChunkPlan> PlanChunks(std::span<const TensorMeta> tensors, size_t buffer_size_bytes);

// The trainer's packed buffer size: max(bucket_bytes, largest tensor), as SkyRL sizes it,
// so that no single tensor overflows a buffer.
size_t PackedBufferSize(std::span<const TensorMeta> tensors, size_t bucket_bytes);

}  // namespace wsync
