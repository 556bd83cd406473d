#include "receiver/admission.h"

#include <unordered_map>

#include <fmt/format.h>

#include "control/tensor_list.h"
#include "core/checked_math.h"
#include "core/log.h"
#include "model/update_meta.h"

namespace wsync {

using nlohmann::json;

namespace {

const std::shared_ptr<const std::vector<TensorMeta>>& NoTensors() {
  static const auto kNoTensors = std::make_shared<const std::vector<TensorMeta>>();
  return kNoTensors;
}

}  // namespace

UpdateAdmission::UpdateAdmission(const HeldTensors* held, AdmissionOptions options)
    : held_(held), options_(std::move(options)) {}

std::shared_ptr<const json> UpdateAdmission::CacheHit(const json& info) const {
  std::shared_ptr<const json> cached = cached_info_.lock();
  if (cached == nullptr) return nullptr;
  return cached.get() == &info || (options_.compare_values && *cached == info) ? cached : nullptr;
}

AdmittedUpdate UpdateAdmission::Admit(std::shared_ptr<const json> update_info, bool parse) {
  if (update_info == nullptr) {
    static const auto kNoInfo = std::make_shared<const json>(json::object());
    return AdmittedUpdate{kNoInfo, NoTensors(), InvalidArgument("update_info is missing")};
  }
  if (std::shared_ptr<const json> cached = CacheHit(*update_info)) return Hit(std::move(cached));
  return Miss(std::move(update_info), parse);
}

AdmittedUpdate UpdateAdmission::Admit(const json& update_info, bool parse) {
  if (std::shared_ptr<const json> cached = CacheHit(update_info)) return Hit(std::move(cached));
  return Miss(std::make_shared<const json>(update_info), parse);
}

AdmittedUpdate UpdateAdmission::Hit(std::shared_ptr<const json> cached) const {
  return AdmittedUpdate{std::move(cached), cached_tensors_, Status::Ok()};
}

AdmittedUpdate UpdateAdmission::Miss(std::shared_ptr<const json> update_info, bool parse) {
  AdmittedUpdate out{std::move(update_info), NoTensors(), Status::Ok()};
  if (!out.update_info->is_object()) {
    out.reject = InvalidArgument("update_info must be a JSON object");
    return out;
  }
  if (parse) {
    Result<std::vector<TensorMeta>> parsed = ParseTensorList(*out.update_info);
    if (!parsed.ok()) {
      out.reject = parsed.status();
      return out;
    }
    out.tensors = std::make_shared<const std::vector<TensorMeta>>(std::move(*parsed));
    out.reject = Check(*out.tensors);
    if (!out.reject.ok()) return out;
  }
  cached_info_ = out.update_info;
  if (options_.compare_values) owned_info_ = out.update_info;
  cached_tensors_ = out.tensors;
  return out;
}

Status UpdateAdmission::Check(const std::vector<TensorMeta>& tensors) const {
  std::unordered_map<std::string_view, size_t> seen;
  uint64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorMeta& t = tensors[i];
    if (auto [it, fresh] = seen.emplace(t.name, i); !fresh) {
      return InvalidArgument(
          fmt::format("update_info names tensor {} twice (entries {} and {})", t.name, it->second, i));
    }
    std::optional<uint64_t> sum = CheckedAdd<uint64_t>(total, t.nbytes());
    if (!sum || *sum > options_.max_update_bytes) {
      return InvalidArgument(fmt::format("update_info's tensors add up to more than {} bytes (at {}), the "
                                         "max_update_bytes limit", options_.max_update_bytes, t.name));
    }
    total = *sum;
    if (std::string_view reason = held_->DropReason(t.name); !reason.empty()) {
      WSYNC_LOG_DEBUG("{}: update_info: dropping {} ({})", options_.label, t.name, reason);
      continue;
    }
    if (held_->TakesAny()) continue;
    const TensorMeta* want = held_->Find(t.name);
    if (want == nullptr) {
      return InvalidArgument(fmt::format("update_info names tensor {}, which {} does not hold", t.name,
                                         held_->Describe()));
    }
    WSYNC_RETURN_IF_ERROR(CheckUpdateMeta(*want, t.dtype, t.shape));
  }
  return Status::Ok();
}

}  // namespace wsync
