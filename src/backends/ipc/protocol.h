// The `ipc` backend's wire format, version kIpcProtocolVersion (3): the init and update
// payloads both halves agree on, the chunk cut, and the device keys that pick a worker's
// staging buffer.
//
// The colocated backend moves bytes through ONE staging area per trainer session, exported
// once at init and kept mapped by every receiver across syncs (opening a CUDA IPC handle
// is the expensive part on GPU). The session has two parts:
//
//  * the control region: a small POSIX shared-memory file (memfd, or shm_open) holding the
//    hand-off state (see region.h): per-slot sequence numbers the trainer publishes, one
//    acknowledgement word per receiving worker, an abort word, and futex words to sleep on;
//  * the staging slots (`num_slots` of `slot_bytes` each, double buffered), exported per
//    device: on a CPU host they live in the control region itself (kind "shm"); on a GPU
//    they are device memory exported as a CUDA IPC handle or a cuMem* POSIX fd (kinds
//    "cuda_ipc", "cuda_fd"), keyed by the GPU's UUID so that each worker picks the entry
//    of its own GPU, whatever CUDA_VISIBLE_DEVICES says.
//
// init_info (POST /init_weight_transfer_engine), one per server:
//   {"wsync_ipc_protocol": 3, "packed": true, "session": "<32 hex>",
//    "control_path": "/proc/PID/fd/N", "control_bytes": B,
//    "num_slots": 2, "slot_bytes": S, "reader_offset": R0, "reader_count": R,
//    "buffers": {"host-<boot_id>": {"kind": "shm", "offset": O, "stride": T},
//                "GPU-<uuid>": {"kind": "cuda_fd", "offset": 0, "stride": T, "handle": {...}},
//                "GPU-<uuid1>": {"kind": "cuda_ipc", ..., "publisher": 1}},
//    "timeout_seconds": t}
// Several trainer ranks: each rank on a GPU no lower rank is on exports slots
// of its own there (same num_slots, slot_bytes and stride) and packs every chunk into them;
// the ranks gather their descriptors to rank 0 at init (through TrainerOptions::comm) and
// rank 0 sends the merged map. A buffer entry names its `publisher` (omitted: 0, rank 0),
// the index of that rank's line in the control region; a worker waits for that
// publisher's slot words and acknowledges to it (region.h). Ranks on a GPU a lower rank
// already serves, and every rank of a CPU trainer (one host: rank 0's shm slots serve it),
// export nothing. Zero-copy with several publishers: each exports its own tensors, and the
// update's zero_copy.buffers carries every publisher's entry (with its `publisher`); a
// worker maps its GPU's entry and waits for the go on that publisher's line. The ranks
// agree per sync whether it is zero-copy (docs/protocol_ipc.md).
// Worker w of the server (dp index d, tp rank p) is reader R0 + d * TP + p, exactly the
// rank the `nccl` backend would give it minus one (the trainer), so deployments with
// external DP load balancing share one reader numbering.
//
// update_info (POST /update_weights, ONE call per sync, carrying the whole model):
//   {"names", "dtype_names", "shapes"          (vLLM's),
//    "tensor_sizes": [bytes per tensor]          (vLLM's packed-IPC field),
//    "tensor_offsets": [byte offset of each tensor inside its chunk's slot],
//    "chunk_ends": [tensor index one past each chunk's last tensor],
//    "wsync_ipc_protocol": 3, "session": "<32 hex>"}
// The update names no sync: it describes only the layout, so that a trainer sending the
// same tensors sends the same bytes every sync, and a server parses and checks them once
// per session (the HTTP layer hands a byte-identical body back as the same parsed object).
// What changes every sync, its number n and the sequence number q of its first chunk,
// the trainer announces in the control region (IpcRegion::Announce) before it posts the
// update; the server reads it there when the update arrives. Chunk k of the update is
// published in slot (q + k) % num_slots under sequence number q + k; a receiver reads a
// slot only while it carries exactly that number, so a stale or foreign chunk is never
// read. Sequence numbers grow across the syncs of a session.
//
// Zero-copy (stateful) mode, GPU only: the trainer's tensors already sit in ONE exported
// device allocation, so there is nothing to pack. The update adds
//   "zero_copy": {"generation": g, "bytes": B,
//                 "buffers": {"GPU-<uuid>": {"kind": "cuda_ipc", "offset": o, "stride": 0,
//                                             "handle": {...}}}}
// where tensor i lies at the mapping's start + o + tensor_offsets[i], inside [o, o + B);
// chunk_ends is [number of tensors] (one "go", published as sequence q with no slot
// bytes); `buffers` travels only in the first update of generation g (a receiver maps it
// then and keeps it). The trainer bumps g whenever the allocation behind its tensors
// changes (address, size or IPC handle); a receiver reads only a mapping whose session and
// generation equal the update's, and answers 409 for a generation it has not mapped and
// whose handle the update does not carry. In init_info, a trainer that only ever sends
// zero-copy lists its GPU as {"kind": "none", "offset": 0, "stride": 0}: no slots there.
//
// The cut (plan/packing.h, kCloseBeforeOverflow): a chunk is closed BEFORE the tensor
// that would overflow the slot (vLLM's IPC producer, reference §7.2), not after it as
// vLLM's NCCL producer does: a slot is a fixed mapping, so a chunk must fit in it.
// Tensors start at kIpcAlignment-byte offsets so that copies run at full width on both
// CPU and GPU; the slot is sized max(bucket, largest tensor), so every tensor fits.
//
// Pure data and functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

inline constexpr int kIpcProtocolVersion = 3;
inline constexpr size_t kIpcAlignment = 256;  // offset of every tensor inside a slot
inline constexpr int kIpcMaxSlots = 4;
inline constexpr int kIpcDefaultSlots = 2;
// Bounds on what an init_info or a control region may say (both are untrusted).
inline constexpr int kIpcMaxReaders = 1 << 16;     // receiving workers of one session
inline constexpr int kIpcMaxPublishers = 1024;     // trainer ranks with slots of their own
inline constexpr double kIpcMaxTimeoutSeconds = 86400;
inline constexpr uint64_t kIpcMaxRegionBytes = uint64_t{1} << 40;  // a control region with its slots

// One device's view of the staging slots: slot k is at `offset + k * stride` of the
// exported memory. `handle` is what the kind needs to open it: {} for "shm" (the control
// region itself); {"handle_b64"} for "cuda_ipc"; {"pid", "fd", "bytes"} for "cuda_fd";
// kind "none" means the device has no slots (a zero-copy-only trainer). In a zero-copy
// update the same shape names the trainer's own tensors (stride 0). `publisher` is the
// control region's publisher line of the trainer rank that packs into these slots (0:
// rank 0; on the wire only when not 0).
struct IpcBufferDesc {
  std::string kind = "shm";
  uint64_t offset = 0;
  uint64_t stride = 0;
  nlohmann::json handle = nlohmann::json::object();
  int publisher = 0;

  bool operator==(const IpcBufferDesc&) const = default;
  nlohmann::json ToJson() const;
  // `parent` names the object holding the entry in messages. A device key is at most
  // kMaxNameBytes (core/json_limits.h).
  static Result<IpcBufferDesc> Parse(const nlohmann::json& j, const std::string& key,
                                     const char* parent = "init_info");
};

struct IpcInitInfo {
  int wsync_ipc_protocol = kIpcProtocolVersion;
  bool packed = true;
  std::string session;       // 32 lowercase hex digits, fresh per trainer Init
  std::string control_path;  // a path this host can open(2): /proc/PID/fd/N or /dev/shm/NAME
  uint64_t control_bytes = 0;
  int num_slots = kIpcDefaultSlots;
  uint64_t slot_bytes = 0;
  int reader_offset = 0;  // this server's first reader index
  int reader_count = 0;   // readers (receiving workers) of the whole session
  std::map<std::string, IpcBufferDesc> buffers;  // device key -> that device's slots
  std::optional<double> timeout_seconds;         // the trainer's bound on the servers' waits
  // The trainer digests on its GPU (engine/device_digests.h): a tensor over 32 MiB comes
  // digested by row ranges.
  bool wsync_device_digests = false;

  nlohmann::json ToJson() const;
  // InvalidArgument naming the field for a missing, mistyped, unknown or out-of-range one.
  static Result<IpcInitInfo> Parse(const nlohmann::json& j);
  // The buffer entry of device `key` (HostDeviceKey() or a GPU's "GPU-<uuid>"); a missing
  // one is InvalidArgument naming the key and the keys offered.
  Result<const IpcBufferDesc*> FindBuffer(const std::string& key) const;
};

// The zero-copy fields of an update (see the file comment).
struct IpcZeroCopy {
  uint64_t generation = 0;  // >= 1 within a session
  uint64_t bytes = 0;       // the tensors' extent from their buffer's offset
  std::map<std::string, IpcBufferDesc> buffers;  // only in a generation's first update
  bool operator==(const IpcZeroCopy&) const = default;
};

// The ipc-specific fields of one update (the tensor list itself is parsed by the server).
struct IpcUpdateInfo {
  std::string session;
  // Not on the wire: what the trainer announced in the control region for this sync.
  uint64_t sync = 0;       // 1, 2, ... within the session
  uint64_t first_seq = 0;  // sequence number of the update's first chunk (>= 1)
  std::vector<uint64_t> tensor_sizes;
  std::vector<uint64_t> tensor_offsets;
  std::vector<uint64_t> chunk_ends;
  std::optional<IpcZeroCopy> zero_copy;

  bool operator==(const IpcUpdateInfo&) const = default;
  size_t num_chunks() const { return chunk_ends.size(); }
  size_t chunk_first(size_t k) const { return k == 0 ? 0 : chunk_ends[k - 1]; }
  // Adds the ipc fields to an update_info that already has names/dtype_names/shapes
  // (all but sync and first_seq, which travel in the control region).
  void AddTo(nlohmann::json* update_info) const;
  // Parses the ipc fields (sync and first_seq stay 0); rejects vLLM's torch-pickled
  // handles with a clear message, and a session that is not 32 lowercase hex digits.
  static Result<IpcUpdateInfo> Parse(const nlohmann::json& update_info);
  // Checks the update against the tensors the server parsed and the mapped slots: sizes
  // match dtype x shape, chunks cover the tensors in order, every tensor lies inside its
  // slot ("chunk 3/9 needs 1073742080 bytes, the mapped slots hold 1073741824") and no
  // two overlap. InvalidArgument naming the tensor or chunk otherwise. A zero-copy update
  // is one chunk bounded by zero_copy.bytes instead of the slots.
  Status Validate(std::span<const TensorMeta> tensors, uint64_t slot_bytes) const;
};

// The chunk cut (see the file comment) of `tensors` for slots of `slot_bytes`.
struct IpcPlan {
  std::vector<uint64_t> tensor_offsets;  // inside the tensor's chunk
  std::vector<uint64_t> chunk_ends;
  std::vector<uint64_t> chunk_bytes;     // bytes of the slot each chunk uses (with padding)
  uint64_t payload_bytes = 0;            // sum of the tensors' bytes
};
// InvalidArgument naming the tensor when one is larger than a slot.
Result<IpcPlan> PlanIpcChunks(std::span<const TensorMeta> tensors, uint64_t slot_bytes);

// The slot size the trainer exports: max(bucket, largest tensor), but never more than one
// chunk holding the whole model needs (a small model does not reserve a whole bucket).
uint64_t IpcSlotBytes(std::span<const TensorMeta> tensors, uint64_t bucket_bytes);

// Reader numbering: servers are listed deployment-major, `data_parallel_size` per
// deployment, and each reports its deployment's worker count (/get_world_size with
// include_dp). The servers of one deployment share an offset (each worker adds its own
// dp_index * TP); deployments follow each other, and may differ in size (a TP=1 and a
// TP=2 server). Fills `offsets` (one per server) and returns the total reader count.
// InvalidArgument when the servers do not divide into deployments or a deployment's
// servers disagree on its size.
Result<int> IpcReaderOffsets(const std::vector<int>& world_sizes, int data_parallel_size,
                             std::vector<int>* offsets);

// The device key of host memory on this machine: "host-" + the kernel's boot id, so that
// a server on another machine finds no entry instead of opening a wrong file.
std::string HostDeviceKey();

// At most `max_bytes` of `s` for a message, never cutting a UTF-8 sequence ("..." marks
// a cut).
std::string IpcClip(std::string_view s, size_t max_bytes);

// 32 random lowercase hex digits.
std::string NewSessionId();

}  // namespace wsync
