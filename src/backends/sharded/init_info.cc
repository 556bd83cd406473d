#include "backends/sharded/init_info.h"

namespace wsync {

// Skeleton: the receiver helper replaces these.
nlohmann::json ShardedInitInfo::ToJson() const { return nlohmann::json::object(); }
Result<ShardedInitInfo> ShardedInitInfo::Parse(const nlohmann::json&) { return Unimplemented("ShardedInitInfo"); }

}  // namespace wsync
