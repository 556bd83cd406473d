// The NCCL unique id as vLLM's UID rendezvous puts it on the wire: `nccl_unique_id_b64`,
// standard (not URL-safe) base64 of the 128 raw bytes of an ncclUniqueId, checked strictly
// (vLLM decodes with validate=True and a length test). Pure CPU code (OpenSSL's base64),
// so it builds and is tested without CUDA. Thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "wsync/status.h"

namespace wsync {

inline constexpr size_t kNcclUniqueIdBytes = 128;
using NcclUniqueIdBytes = std::array<uint8_t, kNcclUniqueIdBytes>;

std::string EncodeNcclUniqueId(const NcclUniqueIdBytes& id);
// InvalidArgument for anything but standard base64 of exactly 128 bytes.
Result<NcclUniqueIdBytes> DecodeNcclUniqueId(std::string_view b64);

}  // namespace wsync
