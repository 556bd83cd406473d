// UpdateAdmission on its own: the checks in their order, and the identity cache (the same
// object, or with compare_values an equal one, is handed back as the cached objects; a
// refused update is never cached).
#include "receiver/admission.h"

#include <gtest/gtest.h>

namespace wsync {
namespace {

using nlohmann::json;

// Holds "a" (bf16 [4]); drops "rotary".
class TwoNames final : public HeldTensors {
 public:
  std::string_view DropReason(std::string_view name) const override {
    return name == "rotary" ? "a rotary buffer" : "";
  }
  const TensorMeta* Find(std::string_view name) const override { return name == "a" ? &a_ : nullptr; }

 private:
  const TensorMeta a_{"a", DType::kBF16, {4}};
};

json Info(std::vector<std::string> names) {
  json info{{"names", json::array()}, {"dtype_names", json::array()}, {"shapes", json::array()}};
  for (const std::string& n : names) {
    info["names"].push_back(n);
    info["dtype_names"].push_back("bfloat16");
    info["shapes"].push_back({4});
  }
  return info;
}

TEST(UpdateAdmission, ChecksNamesBytesAndWhatTheWorkerHolds) {
  TwoNames held;
  UpdateAdmission admission(&held, AdmissionOptions{.max_update_bytes = 16});
  EXPECT_TRUE(admission.Admit(Info({"a", "rotary"}), true).reject.ok());
  EXPECT_EQ(admission.Admit(Info({"a", "a"}), true).reject.message(),
            "update_info names tensor a twice (entries 0 and 1)");
  EXPECT_EQ(admission.Admit(Info({"b"}), true).reject.message(),
            "update_info names tensor b, which the worker does not hold");
  EXPECT_EQ(admission.Admit(Info({"a", "rotary", "x"}), true).reject.message(),
            "update_info's tensors add up to more than 16 bytes (at x), the max_update_bytes limit");
  EXPECT_EQ(admission.Admit(json(7), true).reject.message(), "update_info must be a JSON object");
  EXPECT_EQ(admission.Admit(std::shared_ptr<const json>(), true).reject.message(), "update_info is missing");
  AdmittedUpdate own = admission.Admit(json{{"target_version", 3}}, /*parse=*/false);
  EXPECT_TRUE(own.reject.ok());
  EXPECT_TRUE(own.tensors->empty());
}

TEST(UpdateAdmission, TheSameObjectIsCheckedOnceAndHandedBackAsTheCachedObjects) {
  TwoNames held;
  UpdateAdmission admission(&held, AdmissionOptions{});
  auto body = std::make_shared<const json>(Info({"a"}));
  AdmittedUpdate first = admission.Admit(body, true);
  AdmittedUpdate again = admission.Admit(body, true);
  EXPECT_EQ(again.update_info, body);
  EXPECT_EQ(again.tensors, first.tensors);
  // Without compare_values an equal copy is parsed afresh, and the cache owns no body.
  AdmittedUpdate copy = admission.Admit(std::make_shared<const json>(*body), true);
  EXPECT_NE(copy.tensors, first.tensors);
  std::weak_ptr<const json> weak = copy.update_info;
  copy = AdmittedUpdate{};
  EXPECT_TRUE(weak.expired());
}

TEST(UpdateAdmission, CompareValuesHitsOnAnEqualBodyButNeverOnARefusedOne) {
  TwoNames held;
  UpdateAdmission admission(&held, AdmissionOptions{.compare_values = true});
  AdmittedUpdate first = admission.Admit(Info({"a"}), true);
  AdmittedUpdate again = admission.Admit(Info({"a"}), true);
  EXPECT_EQ(again.update_info, first.update_info);
  EXPECT_EQ(again.tensors, first.tensors);
  EXPECT_FALSE(admission.Admit(Info({"a", "a"}), true).reject.ok());
  EXPECT_FALSE(admission.Admit(Info({"a", "a"}), true).reject.ok());
  EXPECT_EQ(admission.Admit(Info({"a"}), true).update_info, first.update_info);
}

}  // namespace
}  // namespace wsync
