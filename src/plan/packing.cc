#include "plan/packing.h"

#include <algorithm>

#include <fmt/format.h>

namespace wsync {

Result<ChunkPlan> CutChunks(std::span<const TensorMeta> tensors, const ChunkCut& cut) {
  if (cut.limit == 0) return InvalidArgument(fmt::format("the size of {} must be positive", cut.limit_name));
  if (cut.alignment == 0) return InvalidArgument("the chunk alignment must be positive");
  const bool before = cut.rule == ChunkCut::Rule::kCloseBeforeOverflow;
  ChunkPlan plan;
  plan.offset_in_chunk.resize(tensors.size());
  Chunk current;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t bytes = tensors[i].nbytes();
    if (before && bytes > cut.limit) {
      return InvalidArgument(fmt::format("tensor {} ({} bytes) is larger than {} ({} bytes)", tensors[i].name,
                                         bytes, cut.limit_name, cut.limit));
    }
    size_t offset = (current.bytes + cut.alignment - 1) / cut.alignment * cut.alignment;
    if (before && current.end > current.first && (offset > cut.limit || bytes > cut.limit - offset)) {
      plan.chunks.push_back(current);
      current = Chunk{i, i, 0};
      offset = 0;
    }
    plan.offset_in_chunk[i] = offset;
    current.bytes = offset + bytes;
    current.end = i + 1;
    if (!before && current.bytes > cut.limit) {  // strictly greater, as vLLM cuts
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

Result<ChunkPlan> PlanChunks(std::span<const TensorMeta> tensors, size_t buffer_size_bytes) {
  if (buffer_size_bytes == 0) return InvalidArgument("packed_buffer_size_bytes must be positive");
  return CutChunks(tensors, ChunkCut{ChunkCut::Rule::kCloseAfterOverflow, buffer_size_bytes, 1});
}

size_t PackedBufferSize(std::span<const TensorMeta> tensors, size_t bucket_bytes) {
  size_t size = bucket_bytes;
  for (const auto& t : tensors) size = std::max(size, t.nbytes());
  return size;
}

}  // namespace wsync
