#include "plan/sharded_plan.h"

namespace wsync {

// Skeleton: the plan helper replaces every body below.
std::vector<int> AssignProducerIndices(int, int, int) { return {}; }
std::string MetadataDigest(const std::vector<std::string>&) { return ""; }
Result<Ownership> ResolveOwnership(const std::vector<std::string>&, const std::vector<std::vector<bool>>&) {
  return Unimplemented("ResolveOwnership");
}
Result<RdtRouter> RdtRouter::Create(int, int, Ownership, const std::vector<int>&, int) {
  return Unimplemented("RdtRouter");
}
int RdtRouter::ProducerFor(int, int) const { return 0; }
std::vector<int> RdtRouter::GroupOwners(int) const { return {}; }
size_t ConsumerPlan::bytes() const { return 0; }
size_t ConsumerPlan::max_chunk_bytes() const { return 0; }
Result<ConsumerPlan> PlanConsumer(const ShardedStream&, const ShardingTable&, const ConsumerSpot&) {
  return Unimplemented("PlanConsumer");
}
ProducerPlan PlanProducer(int producer, int, const std::vector<ConsumerPlan>&) { return ProducerPlan{producer}; }
void PackSliceHost(const ShardingTable&, const PlanSlice&, const std::byte*, std::byte*) {}

}  // namespace wsync
