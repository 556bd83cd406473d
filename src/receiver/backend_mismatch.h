// Naming a backend mismatch: an init_info meant for another backend than the server's.
//
// Each backend's init_info has fields no other backend sends, and may also send fields
// another backend lists as its own (sharded meets its group with nccl's rendezvous
// fields): its SHARED fields. Both lists are the backend's own, in its descriptor
// (src/backends/descriptor.h, BackendDescriptor::init_info_fields and
// shared_init_info_fields), read here through the registry. An init_info carrying some of
// another backend's own fields and none of the server's own backend's fields, other than
// that backend's shared ones, is that other backend's, and the server answers
// FailedPrecondition naming both backends, the field that gave it away and the two ways
// out, instead of whatever its own parser makes of foreign fields. Each backend's parser
// stays the authority on what its init_info means (src/backends/init_info_fields_test.cc
// checks that every parser accepts the fields its descriptor lists). Pure functions,
// thread-safe.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "wsync/status.h"

namespace wsync {

// The init_info fields only backend `backend` sends; empty for a name not registered.
const std::vector<std::string>& InitInfoFieldsOf(std::string_view backend);
// The fields backend `backend` sends that are listed for another backend.
const std::vector<std::string>& InitInfoSharedFieldsOf(std::string_view backend);
// The registered backends, in registry order.
std::vector<std::string> InitInfoBackends();

struct InitInfoGuess {
  std::string backend;  // the backend whose fields the init_info carries
  std::string field;    // the first such field (in the init_info's key order)
};
// The backend other than `server_backend` that `init_info` is for, or nullopt when it
// carries a field of `server_backend` that backend does not share, no field of any known
// backend, or is not an object. With fields of several other backends, the one with the most fields wins
// (the first in registry order on a tie).
std::optional<InitInfoGuess> GuessForeignInitInfo(std::string_view server_backend,
                                                  const nlohmann::json& init_info);

// OK unless GuessForeignInitInfo names another backend; then FailedPrecondition:
// "this server runs backend 'nccl'; the init_info is for backend 'ipc' (field
// 'buffers'): start the server with --backend ipc or push with --backend nccl".
Status CheckInitInfoBackend(std::string_view server_backend, const nlohmann::json& init_info);

}  // namespace wsync
