// MegatronSource's held pass: the names its TP group holds, assembled inside the TP group
// with point-to-point exchanges planned by held_plan.h.
#include <algorithm>

#include <fmt/format.h>

#include "sources/sources.h"

namespace wsync {
namespace {

// Held-pass messages carry the tag kHeldTag | parity << 30 | layer group index. The top
// bit keeps them apart from other point-to-point traffic on the trainer communicator.
// Equal tags between two ranks match in posting order, so passes cannot mix while every
// member makes the same passes; the pass's parity turns a member that skipped a pass
// into a timeout instead of a mix of two passes' bytes.
constexpr uint32_t kHeldTag = uint32_t{1} << 31;
constexpr size_t kHeldGroupLimit = size_t{1} << 30;

}  // namespace

Status MegatronSource::PlanHeld() {
  const ParallelLayout& l = layout_->layout();
  const auto& hf = layout_->hf_tensors();
  const int me = comm_->rank();
  if (groups_.size() >= kHeldGroupLimit) {
    return InvalidArgument(fmt::format("megatron source: {} layer groups, the held pass tags at most {}",
                                       groups_.size(), kHeldGroupLimit));
  }
  // Every rank plans every TP group, so a layout in which one TP group cannot assemble a
  // held tensor fails Create() on every rank alike.
  for (int r = 0; r < l.world; ++r) {
    if (l.CoordOf(r).tp != 0) continue;
    std::vector<int> ranks = TpGroupRanks(l, r);
    auto mine = std::find(ranks.begin(), ranks.end(), me);
    const int member = mine == ranks.end() ? 0 : static_cast<int>(mine - ranks.begin());
    WSYNC_ASSIGN_OR_RETURN(std::vector<HeldGroupPlan> plan, PlanHeldPass(hf, groups_, l.tp, member,
                                                                         HeldPiecesOf(*layout_, r),
                                                                         DescribeTpGroup(ranks)));
    if (mine == ranks.end()) continue;
    tp_member_ = member;
    tp_group_ = std::move(ranks);
    held_plan_ = std::move(plan);
  }
  std::vector<std::string> planned;
  for (const HeldGroupPlan& p : held_plan_) {
    for (int h : p.names) planned.push_back(hf[h].name);
    max_held_group_ = std::max(max_held_group_, p.bytes);
    // Packed slices: this member's to send and the others' received, the whole group.
    if (tp_group_.size() > 1) max_held_staging_ = std::max(max_held_staging_, p.bytes);
  }
  if (planned != held_) {
    return Internal(fmt::format("megatron source on {}: the held-pass plan covers {} names, HeldNames() {}",
                                DescribeRankOrDefault(options_.describe_rank, me), planned.size(), held_.size()));
  }
  return Status::Ok();
}

Status MegatronSource::LoadHeldGroup(size_t k, uint32_t tag, Deadline deadline) {
  const HeldGroupPlan& plan = held_plan_[k];
  const int members = static_cast<int>(tp_group_.size()), me = tp_member_;
  // staging_ holds the members' contributions back to back, by tp coordinate.
  std::vector<size_t> at(members, 0);
  std::vector<Communicator::PeerMessage> sends, receives;
  if (members > 1) {
    size_t used = 0;
    for (int t = 0; t < members; ++t) {
      at[t] = used;
      used += plan.contribution[t];
    }
    std::span<std::byte> mine = staging_.span().subspan(at[me], plan.contribution[me]);
    PackRuns(plan.runs[me], params_, mine.data());
    for (int t = 0; t < members; ++t) {
      if (t == me) continue;
      if (!mine.empty()) sends.push_back({tp_group_[t], tag, mine});
      if (plan.contribution[t] > 0) {
        receives.push_back({tp_group_[t], tag, staging_.span().subspan(at[t], plan.contribution[t])});
      }
    }
  }
  Status exchanged;
  std::unique_ptr<Communicator::PeerBatch> batch;
  if (!sends.empty() || !receives.empty()) {
    Result<std::unique_ptr<Communicator::PeerBatch>> posted = comm_->PostPeerBatch(sends, receives);
    if (posted.ok()) {
      batch = std::move(*posted);
    } else {
      exchanged = posted.status();
    }
  }
  if (exchanged.ok()) {
    // This member's own slices go straight from its parameters while the messages fly.
    PlaceRuns(plan.runs[me], params_, group_.data());
    PlaceRuns(plan.own, params_, group_.data());
    if (batch) exchanged = batch->Wait(deadline);
  }
  if (!exchanged.ok()) {
    return ExplainCollectiveFailure(
        options_, exchanged,
        fmt::format("megatron held pass of group '{}' on {}: exchange of {} bytes within {}", groups_[plan.group].key,
                    DescribeRankOrDefault(options_.describe_rank, comm_->rank()), plan.bytes,
                    DescribeTpGroup(tp_group_)),
        " (every rank of a TP group must drain every held pass; one that stopped iterating or died "
        "leaves the rest of its TP group waiting)");
  }
  for (int t = 0; t < members; ++t) {
    if (t != me) UnpackRuns(plan.runs[t], staging_.data() + at[t], group_.data());
  }
  return Status::Ok();
}

class MegatronSource::HeldStream final : public TensorStream {
 public:
  HeldStream(MegatronSource* src, uint32_t parity) : src_(src), parity_(parity) {
    for (const HeldGroupPlan& p : src_->held_plan_) left_ += p.names.size();
  }
  ~HeldStream() override {
    // An abandoned pass would leave the rest of the TP group waiting in an exchange.
    if (left_ > 0 && !src_->comm_->aborted()) src_->comm_->Abort();
  }

  Result<bool> Next(TensorRef* out) override {
    WSYNC_RETURN_IF_ERROR(failed_);
    if (left_ == 0) return false;
    const auto& plan = src_->held_plan_;
    if (group_ == SIZE_MAX || name_ >= plan[group_].names.size()) {
      group_ = group_ == SIZE_MAX ? 0 : group_ + 1;
      name_ = 0;
      const uint32_t tag = kHeldTag | parity_ << 30 | static_cast<uint32_t>(plan[group_].group);
      failed_ = src_->LoadHeldGroup(group_, tag, Deadline::InSeconds(src_->options_.timeout_seconds));
      WSYNC_RETURN_IF_ERROR(failed_);
    }
    const HeldGroupPlan& p = plan[group_];
    const TensorMeta& m = src_->metadata()[p.names[name_]];
    *out = TensorRef{m.name, m.dtype, m.shape, src_->group_.span().subspan(p.offsets[name_], m.nbytes()), Device{}};
    ++name_;
    --left_;
    return true;
  }

 private:
  MegatronSource* src_;
  uint32_t parity_;
  size_t left_ = 0;  // names not yet yielded
  size_t group_ = SIZE_MAX;
  size_t name_ = 0;
  Status failed_;
};

Result<std::unique_ptr<TensorStream>> MegatronSource::IterateHeld() {
  WSYNC_RETURN_IF_ERROR(CheckNotAborted());
  WSYNC_RETURN_IF_ERROR(Reserve(max_held_group_, max_held_staging_));
  const uint32_t parity = held_passes_++ & 1;
  return std::unique_ptr<TensorStream>(std::make_unique<HeldStream>(this, parity));
}

}  // namespace wsync
