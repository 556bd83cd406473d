// The `nccl` backend's wire format: the init payload both halves agree on.
//
// Field names follow vLLM's NCCLWeightTransferInitInfo (reference/vllm_weight_transfer.md
// §5.1): rank_offset, world_size, packed, packed_buffer_size_bytes, packed_num_buffers,
// and nccl_unique_id_b64 for the GPU data plane. The CPU data plane (Gloo) adds what its
// rendezvous needs, all prefixed `gloo_`, plus `wsync_protocol` (the version of wsync's
// extensions, kWsyncProtocolVersion, which also turns on the one-integer preflight
// before each update) and, on the GPU path, `wsync_broadcast_piece_bytes` (every chunk's broadcast
// goes as ncclBroadcast calls of at most this many bytes; absent: one call per chunk, as
// vLLM does). A wsync trainer sends the wsync_ fields only to wsync servers, so a vLLM
// server gets vLLM's payload and vLLM's one broadcast per chunk. Unknown fields are
// rejected, as vLLM's dataclass constructor rejects them.
// Pure data and functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "control/init_payloads.h"
#include "plan/packing.h"
#include "wsync/status.h"

namespace wsync {

inline constexpr int kWsyncProtocolVersion = 1;
// Largest broadcast group a server joins (trainer rank 0 and every server worker): the
// cap comes before anything is allocated per rank.
inline constexpr int64_t kMaxNcclWorldSize = kMaxBroadcastWorldSize;
// Bounds on the packing fields, far above any real setting.
inline constexpr int64_t kMaxNcclBufferBytes = int64_t{1} << 40;
inline constexpr int64_t kMaxNcclNumBuffers = 1024;
// Bounds on the text fields, in bytes: the base64 of a 128-byte ncclUniqueId is 172; a
// store host is a literal address (comm/store_address.h) and fits a DNS name's 253.
inline constexpr size_t kMaxNcclUniqueIdB64Bytes = 256;
inline constexpr size_t kMaxGlooStoreHostBytes = 253;
inline constexpr size_t kMaxGlooPrefixBytes = 256;
inline constexpr size_t kMaxGlooRankLabelBytes = 256;
// The piece size a wsync trainer asks of wsync servers: large enough for NCCL's full
// bandwidth, small enough that packing and unpacking overlap the wire inside a chunk.
inline constexpr int64_t kWsyncBroadcastPieceBytes = int64_t{256} << 20;

// The refusal of vLLM's TCPStore rendezvous (init_info with master_address/master_port):
// there the NCCL unique id travels through torch's StatelessProcessGroup, whose
// broadcast_obj pickles it, and unpickling bytes from the network runs arbitrary code;
// wsync never unpickles. The unique-id mode carries the same id as plain base64.
inline constexpr const char* kTcpStoreRefusal =
    "init_info names master_address/master_port: vLLM's TCPStore rendezvous, where the NCCL unique id "
    "is exchanged as a pickled Python object (StatelessProcessGroup.broadcast_obj), and unpickling "
    "network bytes can run arbitrary code, so wsync never joins it. Send the id itself instead: "
    "nccl_unique_id_b64 (standard base64 of the 128-byte ncclUniqueId; vLLM's unique-id mode) for "
    "the GPU data plane, or gloo_store_host/gloo_store_port/gloo_prefix for wsync's CPU data plane "
    "(docs/protocol.md)";

struct NcclInitInfo {
  int rank_offset = 1;
  int world_size = 0;
  bool packed = false;  // vLLM's worker-side default
  int64_t packed_buffer_size_bytes = static_cast<int64_t>(kDefaultPackedBufferBytes);
  int packed_num_buffers = kDefaultPackedNumBuffers;
  // GPU data plane: standard base64 of the 128-byte ncclUniqueId.
  std::optional<std::string> nccl_unique_id_b64;
  // CPU data plane (Gloo): where the trainer's rendezvous store listens.
  std::optional<std::string> gloo_store_host;
  std::optional<int> gloo_store_port;
  std::optional<std::string> gloo_prefix;       // unique per init
  std::vector<std::string> gloo_rank_labels;    // names of ranks, for error messages
  std::optional<int> wsync_protocol;            // set by wsync trainers
  std::optional<int64_t> wsync_broadcast_piece_bytes;  // NCCL pieces per chunk (wsync peers)
  std::optional<double> timeout_seconds;        // the trainer's bound on waits
  // The trainer digests on its GPU (engine/device_digests.h): a tensor over 32 MiB comes
  // digested by row ranges. GPU data plane only; sent to wsync servers.
  bool wsync_device_digests = false;

  bool uses_gloo() const { return gloo_store_host.has_value(); }
  nlohmann::json ToJson() const;
  // InvalidArgument naming the field for a missing, mistyped, unknown or out-of-range one.
  // Integers are exact and range-checked (core/json_int.h): world_size in
  // [2, kMaxNcclWorldSize], rank_offset in [1, world_size), gloo_store_port in [1, 65535].
  // Text fields are printable ASCII within the kMax*Bytes bounds above; a refused value is
  // shown as a flat excerpt (core/json_limits.h).
  static Result<NcclInitInfo> Parse(const nlohmann::json& j);
};

}  // namespace wsync
