// The static plan of a Megatron held pass (MegatronSource::IterateHeld): which member of
// a TP group sends which slice of which held HF tensor to the other members.
//
// A TP group is the tp ranks of one pipeline stage, one ep coordinate and one dp replica.
// Between them its members hold whole HF tensors (MegatronLayout::HeldNames). Two kinds:
//  - OWN tensors: some member holds the whole tensor in its own parameters (norms and
//    routers replicated on every member; an expert on its expert-EP rank when etp = 1).
//    Exactly the members holding it whole hold it; they place it from their parameters
//    and nothing of it crosses the group.
//  - EXCHANGED tensors: no member holds them whole (attention and dense MLP weights split
//    over tp; an expert split over etp > 1 consecutive members). Every member holds them.
//    For every element the plan picks ONE copy: the lowest member (by tp coordinate)
//    holding it. A member's picked slices in one layer group, in metadata order, are its
//    contribution to that group, packed back to back. In a pass, every member sends its
//    contribution to every other member and assembles the group's exchanged tensors from
//    its own slices and the others' contributions, so every member yields the same bytes.
// Keeping an expert on its own rank means a sender under expert parallelism sends the
// experts it trained, and no TP peer receives experts it never sends.
//
// The plan is made once, when a source is built, from tables every rank shares; the
// functions here are pure and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/sharding.h"
#include "sources/groups.h"
#include "sources/layout.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// A slice of one HF tensor held by a member: all of params()[param].pieces[k] of that
// member's rank, which covers indices [start, start + length) along `dim`.
struct HeldPiece {
  int member = 0;  // tp coordinate in the TP group
  int param = 0;
  int dim = 0;
  int64_t start = 0;
  int64_t length = 0;
  PieceRuns runs;  // of the whole piece (MegatronLayout::Runs)
};

// Byte runs a member contributes to a group: `runs` between its params()[param] (dst_*)
// and the HF tensor that starts at `group_offset` in the assembled group (hf_*).
struct HeldRun {
  int param = 0;
  size_t group_offset = 0;
  PieceRuns runs;
};

// One layer group of member `me`'s held pass: the tensors it holds and who contributes what.
struct HeldGroupPlan {
  size_t group = 0;             // index into the source's layer groups
  std::vector<int> names;       // HF indices `me` holds in the group, in metadata order
  std::vector<size_t> offsets;  // of each name in `me`'s assembled group, in bytes
  size_t bytes = 0;             // `me`'s assembled group
  std::vector<std::vector<HeldRun>> runs;  // [member] its contribution, in packing order
  std::vector<size_t> contribution;        // [member] its contribution's packed bytes
  std::vector<HeldRun> own;                // `me`'s own tensors, placed from its parameters
};

// The plan of member `me` of one TP group of `members` ranks over `hf` (metadata order) and
// its layer `groups`. pieces[h] lists what the members hold of HF tensor h, in any order;
// empty means the group does not hold h. Groups in which `me` holds nothing get no plan.
// Contributions are the same in every member's plan; names, offsets and `own` are `me`'s.
// InvalidArgument naming the tensor and `tp_group` when the members' slices of a held
// tensor leave indices uncovered or slice it along different dims: the group cannot
// assemble it alone.
Result<std::vector<HeldGroupPlan>> PlanHeldPass(const std::vector<TensorMeta>& hf,
                                                const std::vector<LayerGroup>& groups, int members, int me,
                                                const std::vector<std::vector<HeldPiece>>& pieces,
                                                std::string_view tp_group);

// [member] whether that member's non-empty slices among `pieces` (one HF tensor's, sliced
// along one dim of `extent` indices, members in [0, members)) cover the whole tensor. Any
// true makes the tensor an OWN tensor, held by exactly those members.
std::vector<bool> HoldsWhole(std::span<const HeldPiece> pieces, int members, int64_t extent);

// The ranks of `rank`'s TP group, by tp coordinate.
std::vector<int> TpGroupRanks(const ParallelLayout& layout, int rank);
// "the TP group of trainer ranks 4, 5".
std::string DescribeTpGroup(const std::vector<int>& ranks);
// PlanHeldPass's `pieces` for the TP group of `rank`: every piece of every member.
std::vector<std::vector<HeldPiece>> HeldPiecesOf(const MegatronLayout& layout, int rank);

// Copies the runs of one contribution between a rank's parameters and a packed buffer
// (Pack: params -> packed; Unpack: packed -> assembled group), or straight from the
// parameters into the assembled group (Place). Return the packed bytes.
size_t PackRuns(std::span<const HeldRun> runs, const std::vector<HostTensor>& params, std::byte* packed);
size_t UnpackRuns(std::span<const HeldRun> runs, const std::byte* packed, std::byte* group);
void PlaceRuns(std::span<const HeldRun> runs, const std::vector<HostTensor>& params, std::byte* group);

}  // namespace wsync
