// Fuzz target: an NCCL M2N benchmark system or model file (a user's, or a published
// preset). Each parser either refuses the text or yields values inside its bounds that
// write back to text it reads again as the same values.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "planner/m2n.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace wsync::planner;
  std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto s = ParseM2nSystem(text, "system.json"); s.ok()) {
    for (const M2nParallel* p : {&s->train, &s->generation}) {
      for (int v : {p->num_gpus, p->tp, p->cp, p->ep, p->pp, p->fsdp, p->dp}) {
        if (v < 1 || v > kMaxM2nSize) std::abort();
      }
    }
    auto again = ParseM2nSystem(WriteM2nSystem(*s), "written");
    if (!again.ok() || !(*again == *s)) std::abort();
    (void)FleetSpecsOfM2n(*s, "h100");
  }
  if (auto m = ParseM2nModel(text, "model.json"); m.ok()) {
    if (m->size() > kMaxM2nTensors) std::abort();
    for (const wsync::TensorMeta& t : *m) {
      if (t.shape.size() > kMaxM2nDims) std::abort();
      for (int64_t d : t.shape) {
        if (d < 1 || d > kMaxM2nDim) std::abort();
      }
    }
    auto again = ParseM2nModel(WriteM2nModel(*m), "written");
    if (!again.ok() || *again != *m) std::abort();
    (void)ModelOfM2n(*m, "model.json");
  }
  return 0;
}
