// Element-wise dtype casts between the float formats a checkpoint may store and a model
// may run in (f32, bf16, f16), as torch's .to(dtype) does them: the publisher casts a
// bf16 runtime tensor to an f32 on-disk dtype before XORing (SkyRL's
// _stage_tensor_for_publish), and the receiver casts back when it reloads an f32
// checkpoint into bf16 shards. Pure; thread-safe.
#pragma once

#include <cstddef>
#include <span>
#include <string_view>

#include "wsync/dtype.h"
#include "wsync/status.h"

namespace wsync::delta {

// True when Convert() handles `from` -> `to` (equal dtypes always are).
bool CanConvert(DType from, DType to);

// Casts src (elements of `from`) into dst (elements of `to`), round to nearest even.
// InvalidArgument naming `what` when the pair is unsupported or the sizes disagree.
Status Convert(std::span<const std::byte> src, DType from, std::span<std::byte> dst, DType to,
               std::string_view what);

}  // namespace wsync::delta
