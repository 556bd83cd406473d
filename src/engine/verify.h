// Verification by read-back: every server's digest of every tensor it holds, compared
// with the trainer's own digests of a source.
//
// VerifyServers() asks every server of `trainer.servers` for POST /weight_checker
// {"action": "checksum", "algorithm": ...} and, meanwhile, makes one pass over `source`
// hashing each tensor (TrainerDigests: on the device where it can); a server that
// holds FP8 weights (serve --quantization fp8) is compared with the trainer's own
// quantization of each such tensor. Tensors a server lists as "not_held" (checked and
// dropped) are skipped. DataLoss names the server and the first differing tensors.
// The pass over `source` is a pass like a sync's: every trainer rank must make one (a
// rank that does not verify drains its source). Blocks for the servers' checksums,
// bounded by trainer.timeout_seconds.
#pragma once

#include <string>
#include <vector>

#include "core/digest.h"
#include "wsync/source.h"
#include "wsync/status.h"
#include "wsync/trainer.h"

namespace wsync {

Status VerifyServers(const TrainerOptions& trainer, WeightSource& source, DigestAlgorithm algorithm);

// The trainer's side of VerifyServers: the hex digest of each of `tensors` (whole), in
// order. xxh3-128 of tensors on a GPU is taken on the device, one launch per device;
// everything else is hashed on the host, device bytes read back in bounded blocks
// (TensorHexDigest), on DefaultThreads() threads. Errors name the tensor.
Result<std::vector<std::string>> TrainerDigests(DigestAlgorithm algorithm, const std::vector<TensorRef>& tensors);

}  // namespace wsync
