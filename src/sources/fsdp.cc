#include <cstring>

#include <fmt/format.h>

#include "sources/agreement.h"
#include "sources/sources.h"

namespace wsync {
namespace {

int64_t Rows(const TensorMeta& m) { return m.shape.empty() ? 1 : m.shape[0]; }

}  // namespace

TensorMeta FsdpSource::ShardMeta(const TensorMeta& full, int world) {
  TensorMeta s = full;
  if (s.shape.empty()) s.shape = {1};
  s.shape[0] = (Rows(full) + world - 1) / world;
  return s;
}

Status FsdpShardsInto(const std::vector<HostTensor>& full, int rank, int world,
                      std::vector<HostTensor>& shards) {
  if (shards.size() != full.size()) return InvalidArgument("fsdp shards: tensor count differs");
  for (size_t i = 0; i < full.size(); ++i) {
    const TensorMeta& m = full[i].meta;
    TensorMeta sm = FsdpSource::ShardMeta(m, world);
    WSYNC_RETURN_IF_ERROR(CheckSameMeta(sm, shards[i].meta));
    const size_t begin = std::min(full[i].meta.nbytes(), rank * sm.nbytes());
    const size_t n = std::min(sm.nbytes(), full[i].meta.nbytes() - begin);
    std::memcpy(shards[i].storage.data(), full[i].storage.data() + begin, n);
    std::memset(shards[i].storage.data() + n, 0, sm.nbytes() - n);
  }
  return Status::Ok();
}

Result<std::vector<HostTensor>> FsdpShards(const std::vector<HostTensor>& full, int rank, int world) {
  std::vector<HostTensor> shards;
  for (const HostTensor& t : full) {
    WSYNC_ASSIGN_OR_RETURN(HostTensor s, HostTensor::Zeros(FsdpSource::ShardMeta(t.meta, world)));
    shards.push_back(std::move(s));
  }
  WSYNC_RETURN_IF_ERROR(FsdpShardsInto(full, rank, world, shards));
  return shards;
}

Result<std::unique_ptr<FsdpSource>> FsdpSource::Create(std::shared_ptr<Communicator> comm,
                                                       std::vector<TensorMeta> metadata,
                                                       std::vector<HostTensor> shards,
                                                       SourceOptions options) {
  if (!comm) return InvalidArgument("fsdp source: no trainer communicator");
  const int world = comm->size();
  auto me = DescribeRankOrDefault(options.describe_rank, comm->rank());
  // Local mistakes still join the collective check, so peers fail too instead of hanging.
  Status local;
  if (shards.size() != metadata.size()) {
    local = InvalidArgument(fmt::format("fsdp source on {}: {} shards for {} tensors", me,
                                        shards.size(), metadata.size()));
  }
  for (size_t i = 0; local.ok() && i < shards.size(); ++i) {
    local = CheckSameMeta(ShardMeta(metadata[i], world), shards[i].meta)
                .WithContext(fmt::format("fsdp source on {}: shard {}", me, i));
  }
  std::vector<std::string> names;
  for (const TensorMeta& m : metadata) names.push_back(m.name);
  auto groups = LayerGroups(names);
  if (local.ok() && !groups.ok()) local = groups.status();
  Deadline deadline = Deadline::InSeconds(options.timeout_seconds);
  Status agreed = CheckRanksAgree(*comm, metadata,
                                  local.ok() ? std::nullopt : std::optional<std::vector<std::string>>(
                                                                  std::vector<std::string>{}),
                                  options.describe_rank, deadline);
  if (!local.ok()) return local;
  WSYNC_RETURN_IF_ERROR(agreed);

  std::unique_ptr<FsdpSource> s(new FsdpSource());
  s->comm_ = std::move(comm);
  s->metadata_ = std::move(metadata);
  s->shards_ = std::move(shards);
  s->groups_ = std::move(*groups);
  s->options_ = std::move(options);
  return s;
}

class FsdpSource::Stream final : public TensorStream {
 public:
  explicit Stream(FsdpSource* src) : src_(src) {}
  ~Stream() override {
    // An abandoned pass would leave the other ranks waiting in a gather.
    if (next_ < src_->metadata_.size() && !src_->comm_->aborted()) src_->comm_->Abort();
  }

  Result<bool> Next(TensorRef* out) override {
    const auto& meta = src_->metadata_;
    if (next_ >= meta.size()) return false;
    const size_t i = next_++;
    Communicator& comm = *src_->comm_;
    const HostTensor& shard = src_->shards_[i];
    const size_t n = shard.meta.nbytes(), total = n * comm.size();
    if (src_->gathered_.size() < total) {
      src_->gathered_ = HostBuffer();
      WSYNC_ASSIGN_OR_RETURN(src_->gathered_, HostBuffer::Allocate(total));
    }
    src_->Note(src_->gathered_.size());
    Status s = comm.AllGather(shard.storage.span().first(n), src_->gathered_.span().first(total),
                              Deadline::InSeconds(src_->options_.timeout_seconds));
    if (!s.ok()) {
      return ExplainCollectiveFailure(
          src_->options_, s,
          fmt::format("fsdp source on {}: all-gather of {} (tensor {}/{})",
                      DescribeRankOrDefault(src_->options_.describe_rank, comm.rank()), meta[i].name,
                      i + 1, meta.size()),
          " (every trainer rank must drain every pass, and one that stopped iterating or died "
          "leaves the others waiting)");
    }
    *out = TensorRef{meta[i].name, meta[i].dtype, meta[i].shape,
                     src_->gathered_.span().first(meta[i].nbytes()), Device{}};
    return true;
  }

 private:
  FsdpSource* src_;
  size_t next_ = 0;
};

Result<std::unique_ptr<TensorStream>> FsdpSource::Iterate() {
  if (comm_->aborted()) {
    return ExplainCollectiveFailure(
        options_, Aborted("the trainer communicator was aborted by an earlier failure; build new sources"),
        "fsdp source", "");
  }
  return std::unique_ptr<TensorStream>(std::make_unique<Stream>(this));
}

}  // namespace wsync
