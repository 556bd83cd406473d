#include "plan/packing.h"

#include <algorithm>

namespace wsync {

Result<ChunkPlan> PlanChunks(std::span<const TensorMeta> tensors, size_t buffer_size_bytes) {
  if (buffer_size_bytes == 0) return InvalidArgument("packed_buffer_size_bytes must be positive");
  ChunkPlan plan;
  plan.offset_in_chunk.resize(tensors.size());
  Chunk current;
  for (size_t i = 0; i < tensors.size(); ++i) {
    plan.offset_in_chunk[i] = current.bytes;
    current.bytes += tensors[i].nbytes();
    current.end = i + 1;
    if (current.bytes > buffer_size_bytes) {  // strictly greater, as vLLM cuts
      plan.chunks.push_back(current);
      current = Chunk{i + 1, i + 1, 0};
    }
  }
  if (current.end > current.first) plan.chunks.push_back(current);
  for (const Chunk& c : plan.chunks) {
    plan.max_chunk_bytes = std::max(plan.max_chunk_bytes, c.bytes);
    plan.total_bytes += c.bytes;
  }
  return plan;
}

size_t PackedBufferSize(std::span<const TensorMeta> tensors, size_t bucket_bytes) {
  size_t size = bucket_bytes;
  for (const auto& t : tensors) size = std::max(size, t.nbytes());
  return size;
}

}  // namespace wsync
