#include "control/tensor_list.h"

#include <fmt/format.h>

#include "core/json_limits.h"
#include "core/shape_math.h"

namespace wsync {

using nlohmann::json;

namespace {

Result<const json*> ListField(const json& info, const char* field) {
  auto it = info.find(field);
  if (it == info.end()) return InvalidArgument(fmt::format("update_info is missing '{}'", field));
  if (!it->is_array()) return InvalidArgument(fmt::format("update_info '{}' must be a list", field));
  return &*it;
}

}  // namespace

Result<std::vector<TensorMeta>> ParseTensorList(const json& info) {
  if (!info.is_object()) return InvalidArgument("update_info must be an object");
  WSYNC_ASSIGN_OR_RETURN(const json* names, ListField(info, "names"));
  WSYNC_ASSIGN_OR_RETURN(const json* dtypes, ListField(info, "dtype_names"));
  WSYNC_ASSIGN_OR_RETURN(const json* shapes, ListField(info, "shapes"));
  if (names->size() != dtypes->size() || names->size() != shapes->size()) {
    return InvalidArgument(fmt::format(
        "update_info lists must have equal lengths: names {}, dtype_names {}, shapes {}",
        names->size(), dtypes->size(), shapes->size()));
  }
  std::vector<TensorMeta> out(names->size());
  for (size_t i = 0; i < out.size(); ++i) {
    const json& n = (*names)[i];
    if (!n.is_string()) return InvalidArgument(fmt::format("names[{}] must be a string", i));
    if (n.get_ref<const std::string&>().size() > kMaxNameBytes) {
      return InvalidArgument(fmt::format("names[{}] is {} bytes, over the limit of {}", i,
                                         n.get_ref<const std::string&>().size(), kMaxNameBytes));
    }
    out[i].name = n.get<std::string>();
    const json& d = (*dtypes)[i];
    if (!d.is_string()) {
      return InvalidArgument(fmt::format("dtype_names[{}] ({}) must be a string", i, out[i].name));
    }
    Result<DType> dtype = DTypeFromTorchName(d.get<std::string>());
    if (!dtype.ok()) {
      return dtype.status().WithContext(fmt::format("dtype_names[{}] ({})", i, out[i].name));
    }
    out[i].dtype = *dtype;
    const json& s = (*shapes)[i];
    if (!s.is_array()) {
      return InvalidArgument(fmt::format("shapes[{}] ({}) must be a list of integers", i, out[i].name));
    }
    for (size_t k = 0; k < s.size(); ++k) {
      const json& dim = s[k];
      if (!dim.is_number_integer() || dim.get<int64_t>() < 0) {
        return InvalidArgument(fmt::format("shapes[{}] ({}) must be a list of non-negative integers; item {} is {}",
                                           i, out[i].name, k, JsonExcerpt(dim)));
      }
      out[i].shape.push_back(dim.get<int64_t>());
    }
    if (!CheckedNumBytes(out[i].shape, out[i].dtype)) {
      return InvalidArgument(fmt::format("shapes[{}] ({}) {} has more bytes than int64 counts", i,
                                         out[i].name, ShapeString(out[i].shape)));
    }
  }
  return out;
}

json TensorListJson(const std::vector<TensorMeta>& tensors) {
  json j = {{"names", json::array()}, {"dtype_names", json::array()}, {"shapes", json::array()}};
  for (const TensorMeta& m : tensors) {
    j["names"].push_back(m.name);
    j["dtype_names"].push_back(TorchName(m.dtype));
    j["shapes"].push_back(m.shape);
  }
  return j;
}

Result<std::shared_ptr<const nlohmann::json>> SelectUpdateInfo(std::shared_ptr<const nlohmann::json> info,
                                                                int world_size, const std::vector<int>& ranks) {
  if (info == nullptr || !info->is_array()) return info;
  const size_t n = info->size();
  if (world_size < 1 || n != static_cast<size_t>(world_size)) {
    return InvalidArgument(fmt::format(
        "update_info is a list of {} entries; vLLM's list form takes one per worker of the deployment, "
        "indexed by global worker rank, and this one has {} (/get_world_size)",
        n, world_size));
  }
  const nlohmann::json* first = nullptr;
  int first_rank = -1;
  for (int rank : ranks) {
    if (rank < 0 || static_cast<size_t>(rank) >= n) {
      return Internal(fmt::format("worker rank {} is outside the world of {}", rank, world_size));
    }
    const nlohmann::json& entry = (*info)[static_cast<size_t>(rank)];
    if (!entry.is_object()) {
      return InvalidArgument(fmt::format("update_info entry {} must be an object, not {}", rank, entry.type_name()));
    }
    if (first == nullptr) {
      first = &entry;
      first_rank = rank;
    } else if (entry != *first) {
      return InvalidArgument(fmt::format(
          "update_info entries {} and {} (workers of this server) differ; its backend takes one update_info "
          "for all of its workers, so their entries must be equal",
          first_rank, rank));
    }
  }
  if (first == nullptr) return Internal("a server without workers");
  return std::shared_ptr<const nlohmann::json>(info, first);
}

}  // namespace wsync
