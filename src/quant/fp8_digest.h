// The digests an fp8 server reports for one of its quantized HF tensors, computed from the
// trainer's unquantized tensor: what `push --verify` compares against a server that holds
// FP8 weights (`serve --quantization fp8`).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/digest.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

struct Fp8Digests {
  std::string weight;     // NAME: the e4m3 bytes, HF shape, row-major
  std::string scale_inv;  // NAME_scale_inv: the float32 [ceil(rows/128), ceil(cols/128)] grid
};

// Quantizes `tensor` (2-D; bf16, f16 or f32; on the host or a device) in the 128x128 block
// format 128 rows at a time, hashing each strip's e4m3 bytes and scales as it goes: no
// copy of the whole tensor is made. Device rows are read back through `scratch` (kept
// between calls). InvalidArgument naming the tensor for another rank or dtype.
Result<Fp8Digests> Fp8TensorDigests(DigestAlgorithm algorithm, const TensorRef& tensor,
                                    std::vector<std::byte>& scratch);

}  // namespace wsync
