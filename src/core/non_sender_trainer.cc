#include "core/non_sender_trainer.h"

#include <chrono>

#include <fmt/format.h>

#include "wsync/source.h"

namespace wsync {
namespace {

class NonSenderTrainer final : public TrainerEngine {
 public:
  NonSenderTrainer(int rank, int passes) : rank_(rank), passes_(passes) {}

  Status Init(const std::vector<TensorMeta>&) override { return Status::Ok(); }

  Result<SyncStats> SendWeights(WeightSource& source, const std::optional<std::string>&) override {
    auto t0 = std::chrono::steady_clock::now();
    for (int pass = 1; pass <= passes_; ++pass) {
      Status s = DrainChecked(source);
      if (!s.ok()) return s.WithContext(fmt::format("trainer rank {} (pass {} of {} of the sync)", rank_, pass, passes_));
    }
    SyncStats stats;
    // A checked pass yields exactly what the metadata describes.
    for (const TensorMeta& m : source.metadata()) stats.bytes += m.nbytes();
    stats.tensors = source.metadata().size();
    stats.seconds = stats.transfer_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return stats;
  }

 private:
  int rank_;
  int passes_;
};

}  // namespace

std::unique_ptr<TrainerEngine> NewNonSenderTrainer(int rank, int passes_per_sync) {
  return std::make_unique<NonSenderTrainer>(rank, passes_per_sync);
}

}  // namespace wsync
