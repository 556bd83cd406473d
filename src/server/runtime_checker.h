// The runtime-parameter weight checker of vLLM's POST /weight_checker (the body without an
// "algorithm"): digests and a random overwrite of each worker's parameters as the worker
// holds them (fused qkv_proj and gate_up_proj, padded vocab-parallel embeddings: the
// WorkerStore's params, model/sharding.h), not of HF tensors.
//
// Keys follow vLLM's Worker._weight_checksum_prefix: "dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:{param}";
// this server has no pipeline or context parallelism, so pp and pcp are 0. A digest is the
// SHA-256 (lowercase hex) of the parameter's bytes as held, padding rows included.
//
// A CUDA store is read (and written) in pieces of at most `piece_bytes` through a host
// buffer of that size per thread, never as a whole-model host copy. Work runs over the
// parameters on up to `threads` threads. The caller keeps every other use of the stores
// out while a call runs (InferenceServer holds its session's exclusive call).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/worker_store.h"
#include "quant/fp8_sink.h"
#include "wsync/status.h"

namespace wsync {

// One worker's store and its place in the deployment. On an fp8 server (`fp8` set) a
// quantized parameter is checked as vLLM holds it: NAME (float8 e4m3 bytes) and its
// NAME_scale_inv (float32 block scales, quant/fp8_sharding.h's layout), not its
// model-dtype landing buffer.
struct RuntimeWorker {
  WorkerStore* store = nullptr;
  int dp_rank = 0;
  int tp_rank = 0;
  Fp8WorkerSink* fp8 = nullptr;
};

inline constexpr size_t kRuntimeCheckPieceBytes = size_t{64} << 20;

// vLLM's key of parameter `param` of a worker.
std::string RuntimeParamKey(int dp_rank, int tp_rank, std::string_view param);

// The parameter names a worker reports (its table's, plus NAME_scale_inv after each fp8
// parameter), in table order.
std::vector<std::string> RuntimeParamNames(const RuntimeWorker& worker);

// The digest of every parameter of every worker, keyed by RuntimeParamKey.
Result<std::map<std::string, std::string>> RuntimeParamDigests(std::span<const RuntimeWorker> workers,
                                                               size_t threads,
                                                               size_t piece_bytes = kRuntimeCheckPieceBytes);

// Overwrites every parameter of every worker with pseudo-random finite values drawn from
// `seed` (random bits with each floating-point element's top exponent bit cleared, so
// |x| < 2 and no NaN or infinity; integer parameters get random bits).
Status RandomizeRuntimeParams(std::span<const RuntimeWorker> workers, uint64_t seed, size_t threads,
                              size_t piece_bytes = kRuntimeCheckPieceBytes);

}  // namespace wsync
