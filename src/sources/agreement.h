// CheckRanksAgree: the collective every trainer-rank source runs when it is built.
//
// Every rank of a trainer must describe the WHOLE model with identical metadata (names,
// dtypes, shapes, order), and every tensor must be producible by at least one rank
// (its held names; nullopt holds everything). One all-gather of metadata digests and one
// all-reduce of per-name holder counts establish both; every rank sees the same answer,
// so either every rank succeeds or every rank fails with the same message, which names
// the ranks whose digest differs or the tensors nobody holds. Blocks until `deadline`.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/deadline.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// First 16 hex digits of sha256 over the tensor count and one "name dtype shape" line
// per tensor. Unlike SkyRL's names-only digest, dtype and shape count too: ranks that
// disagree on a shape would otherwise hang mid-gather instead of failing here.
std::string MetadataDigest(const std::vector<TensorMeta>& metadata);

Status CheckRanksAgree(Communicator& comm, const std::vector<TensorMeta>& metadata,
                       const std::optional<std::vector<std::string>>& held,
                       const DescribeRank& describe, Deadline deadline);

}  // namespace wsync
