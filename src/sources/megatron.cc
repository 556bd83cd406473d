#include <cstring>

#include <fmt/format.h>

#include "sources/agreement.h"
#include "sources/sources.h"

namespace wsync {

Result<std::unique_ptr<MegatronSource>> MegatronSource::Create(
    std::shared_ptr<Communicator> comm, std::shared_ptr<const MegatronLayout> layout,
    std::vector<HostTensor> params, SourceOptions options) {
  if (!comm || !layout) return InvalidArgument("megatron source: no communicator or layout");
  const int world = layout->layout().world, me = comm->rank();
  if (comm->size() != world) {
    return InvalidArgument(fmt::format("megatron source: layout {} has {} ranks, the trainer communicator {}",
                                       layout->layout().ToString(), world, comm->size()));
  }
  const std::string who = DescribeRankOrDefault(options.describe_rank, me);
  Status local;
  const auto& table = layout->params(me);
  if (params.size() != table.size()) {
    local = InvalidArgument(fmt::format("megatron source on {}: {} parameters given, the layout has {}",
                                        who, params.size(), table.size()));
  }
  for (size_t i = 0; local.ok() && i < params.size(); ++i) {
    local = CheckSameMeta(table[i].meta, params[i].meta).WithContext("megatron source on " + who);
  }
  std::vector<std::string> names;
  for (const TensorMeta& m : layout->hf_tensors()) names.push_back(m.name);
  auto groups = LayerGroups(names);
  if (local.ok() && !groups.ok()) local = groups.status();
  std::vector<std::string> held = layout->HeldNames(me);
  Status agreed = CheckRanksAgree(*comm, layout->hf_tensors(),
                                  local.ok() ? held : std::vector<std::string>{},
                                  options.describe_rank, Deadline::InSeconds(options.timeout_seconds));
  if (!local.ok()) return local;
  WSYNC_RETURN_IF_ERROR(agreed);

  std::unique_ptr<MegatronSource> s(new MegatronSource());
  s->comm_ = std::move(comm);
  s->layout_ = std::move(layout);
  s->params_ = std::move(params);
  s->groups_ = std::move(*groups);
  s->held_ = std::move(held);
  s->options_ = std::move(options);
  // The export plan: per group, each rank's primary pieces in HF order.
  const auto& hf = s->layout_->hf_tensors();
  s->offset_in_group_.assign(hf.size(), 0);
  size_t max_group = 0, max_contrib = 0;
  for (const LayerGroup& g : s->groups_) {
    std::vector<Contribution> by_rank(world);
    size_t off = 0;
    for (size_t i = g.begin; i < g.end; ++i) {
      s->offset_in_group_[i] = off;
      off += hf[i].nbytes();
      for (const ExportPiece& p : s->layout_->ExportPieces(static_cast<int>(i))) {
        PieceRuns run = s->layout_->Runs(p.rank, p.param, p.piece);
        by_rank[p.rank].pieces.push_back(p);
        by_rank[p.rank].bytes += run.count * run.run_bytes;
      }
    }
    for (const Contribution& c : by_rank) max_contrib = std::max(max_contrib, c.bytes);
    max_group = std::max(max_group, off);
    s->plan_.push_back(std::move(by_rank));
  }
  s->max_group_ = max_group;
  s->max_contribution_ = max_contrib;
  WSYNC_RETURN_IF_ERROR(s->PlanHeld());
  return s;
}

Status MegatronSource::Reserve(size_t group_bytes, size_t staging_bytes) {
  // Buffers are allocated by the first pass that needs them, so a rank that only makes
  // held passes never holds a whole layer group of the model.
  if (group_.size() < group_bytes) {
    group_ = HostBuffer();
    WSYNC_ASSIGN_OR_RETURN(group_, HostBuffer::Allocate(group_bytes));
  }
  if (staging_.size() < staging_bytes) {
    staging_ = HostBuffer();
    WSYNC_ASSIGN_OR_RETURN(staging_, HostBuffer::Allocate(staging_bytes));
  }
  Note(group_.size() + staging_.size());
  return Status::Ok();
}

Status MegatronSource::CheckNotAborted() const {
  if (!comm_->aborted()) return Status::Ok();
  return ExplainCollectiveFailure(
      options_, Aborted("the trainer communicator was aborted by an earlier failure; build new sources"),
      "megatron source", "");
}

Status MegatronSource::LoadGroup(size_t g, Deadline deadline) {
  const int me = comm_->rank();
  for (int r = 0; r < static_cast<int>(plan_[g].size()); ++r) {
    const Contribution& c = plan_[g][r];
    if (c.bytes == 0) continue;
    std::byte* stage = staging_.data();
    if (r == me) {
      size_t at = 0;
      for (const ExportPiece& p : c.pieces) {
        PieceRuns run = layout_->Runs(p.rank, p.param, p.piece);
        const std::byte* src = params_[p.param].storage.data();
        for (int64_t j = 0; j < run.count; ++j, at += run.run_bytes) {
          std::memcpy(stage + at, src + run.dst_offset + j * run.dst_stride, run.run_bytes);
        }
      }
    }
    Status s = comm_->Broadcast(staging_.span().first(c.bytes), r, deadline);
    if (!s.ok()) {
      return ExplainCollectiveFailure(
          options_, s,
          fmt::format("megatron export of group '{}' on {}: broadcast of the {} bytes of pieces held by {}",
                      groups_[g].key, DescribeRankOrDefault(options_.describe_rank, me), c.bytes,
                      DescribeRankOrDefault(options_.describe_rank, r)),
          " (every trainer rank must drain every pass; one that stopped iterating or died "
          "leaves the others, and the ranks relaying to it, waiting)");
    }
    size_t at = 0;
    for (const ExportPiece& p : c.pieces) {
      PieceRuns run = layout_->Runs(p.rank, p.param, p.piece);
      const int hf = layout_->FindHf(layout_->params(p.rank)[p.param].pieces[p.piece].hf_name);
      std::byte* dst = group_.data() + offset_in_group_[hf];
      for (int64_t j = 0; j < run.count; ++j, at += run.run_bytes) {
        std::memcpy(dst + run.hf_offset + j * run.hf_stride, stage + at, run.run_bytes);
      }
    }
  }
  return Status::Ok();
}

class MegatronSource::Stream final : public TensorStream {
 public:
  explicit Stream(MegatronSource* src) : src_(src) {}
  ~Stream() override {
    // An abandoned pass would leave the other ranks waiting in a broadcast.
    if (next_ < src_->metadata().size() && !src_->comm_->aborted()) src_->comm_->Abort();
  }

  Result<bool> Next(TensorRef* out) override {
    const auto& meta = src_->metadata();
    if (next_ >= meta.size()) return false;
    const size_t i = next_++;
    if (group_ >= src_->groups_.size() || i >= src_->groups_[group_].end) {
      group_ = group_ >= src_->groups_.size() ? 0 : group_ + 1;
      WSYNC_RETURN_IF_ERROR(
          src_->LoadGroup(group_, Deadline::InSeconds(src_->options_.timeout_seconds)));
    }
    *out = TensorRef{meta[i].name, meta[i].dtype, meta[i].shape,
                     src_->group_.span().subspan(src_->offset_in_group_[i], meta[i].nbytes()), Device{}};
    return true;
  }

 private:
  MegatronSource* src_;
  size_t next_ = 0;
  size_t group_ = SIZE_MAX;
};

Result<std::unique_ptr<TensorStream>> MegatronSource::Iterate() {
  WSYNC_RETURN_IF_ERROR(CheckNotAborted());
  WSYNC_RETURN_IF_ERROR(Reserve(max_group_, max_contribution_));
  return std::unique_ptr<TensorStream>(std::make_unique<Stream>(this));
}

}  // namespace wsync
