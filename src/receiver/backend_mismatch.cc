#include "receiver/backend_mismatch.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "backends/descriptor.h"

namespace wsync {
namespace {

bool Has(const std::vector<std::string>& fields, const std::string& key) {
  return std::find(fields.begin(), fields.end(), key) != fields.end();
}

const std::vector<std::string>& NoFields() {
  static const std::vector<std::string> kNone;
  return kNone;
}

}  // namespace

const std::vector<std::string>& InitInfoFieldsOf(std::string_view backend) {
  const BackendDescriptor* b = FindBackend(backend);
  return b ? b->init_info_fields : NoFields();
}

const std::vector<std::string>& InitInfoSharedFieldsOf(std::string_view backend) {
  const BackendDescriptor* b = FindBackend(backend);
  return b ? b->shared_init_info_fields : NoFields();
}

std::vector<std::string> InitInfoBackends() {
  std::vector<std::string> names;
  for (const BackendDescriptor* b : Backends()) names.emplace_back(b->name);
  return names;
}

std::optional<InitInfoGuess> GuessForeignInitInfo(std::string_view server_backend,
                                                  const nlohmann::json& init_info) {
  if (!init_info.is_object()) return std::nullopt;
  const std::vector<std::string>& own = InitInfoFieldsOf(server_backend);
  std::optional<InitInfoGuess> best;
  size_t best_count = 0;
  for (const BackendDescriptor* b : Backends()) {
    if (b->name == server_backend) continue;
    // A field of the server's own backend that `b` does not send too rules `b` out.
    bool ruled_out = false;
    for (const auto& [key, _] : init_info.items()) {
      ruled_out = ruled_out || (Has(own, key) && !Has(b->shared_init_info_fields, key));
    }
    if (ruled_out) continue;
    size_t count = 0;
    std::string first;
    for (const auto& [key, _] : init_info.items()) {
      if (!Has(b->init_info_fields, key)) continue;
      if (count++ == 0) first = key;
    }
    if (count > best_count) {
      best_count = count;
      best = InitInfoGuess{std::string(b->name), std::move(first)};
    }
  }
  return best;
}

Status CheckInitInfoBackend(std::string_view server_backend, const nlohmann::json& init_info) {
  std::optional<InitInfoGuess> guess = GuessForeignInitInfo(server_backend, init_info);
  if (!guess) return Status::Ok();
  return FailedPrecondition(fmt::format(
      "this server runs backend '{}'; the init_info is for backend '{}' (field '{}'): start the "
      "server with --backend {} or push with --backend {}",
      server_backend, guess->backend, guess->field, guess->backend, server_backend));
}

}  // namespace wsync
