// The init_info fields each backend's descriptor lists (read by receiver/backend_mismatch.h)
// agree with the backends: every field a wsync trainer of a backend sends is listed for
// that backend, is one of its shared fields, or is sent by every backend; and every field
// listed or shared for a backend is one its own parser takes (never "unknown field").
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include "backends/delta/receiver_request.h"
#include "backends/ipc/protocol.h"
#include "backends/nccl/init_info.h"
#include "backends/sharded/init_info.h"
#include "receiver/backend_mismatch.h"

namespace wsync {
namespace {

using nlohmann::json;

// Fields any backend's init_info may carry.
const std::set<std::string> kShared = {"packed", "timeout_seconds"};

::testing::AssertionResult AllListedFor(const std::string& backend, const json& sent) {
  const std::vector<std::string>& listed = InitInfoFieldsOf(backend);
  const std::vector<std::string>& shared = InitInfoSharedFieldsOf(backend);
  for (const auto& [key, _] : sent.items()) {
    if (kShared.contains(key)) continue;
    if (std::find(shared.begin(), shared.end(), key) != shared.end()) continue;
    if (std::find(listed.begin(), listed.end(), key) == listed.end()) {
      return ::testing::AssertionFailure() << backend << " sends '" << key << "', not in its descriptor's init_info fields";
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(InitInfoFields, EveryFieldATrainerSendsIsListedForItsBackend) {
  NcclInitInfo nccl;
  nccl.world_size = 2;
  nccl.nccl_unique_id_b64 = "x";
  nccl.gloo_store_host = "127.0.0.1";
  nccl.gloo_store_port = 1;
  nccl.gloo_prefix = "p";
  nccl.gloo_rank_labels = {"a", "b"};
  nccl.wsync_protocol = 1;
  nccl.wsync_broadcast_piece_bytes = 1;
  nccl.timeout_seconds = 1;
  EXPECT_TRUE(AllListedFor("nccl", nccl.ToJson()));
  IpcInitInfo ipc;
  ipc.timeout_seconds = 1;
  EXPECT_TRUE(AllListedFor("ipc", ipc.ToJson()));
  // The delta trainer's init_info (backends/delta/trainer.cc) and SkyRL's extra keys.
  EXPECT_TRUE(AllListedFor("delta", json{{"sync_dir", "/s"}, {"format_version", 1}, {"base_model_path", "/b"},
                                         {"local_checkpoint_dir", "/l"}}));
  ShardedInitInfo sharded;
  sharded.gloo_store_host = "127.0.0.1";
  sharded.gloo_store_port = 1;
  sharded.gloo_prefix = "p";
  sharded.nccl_unique_id_b64 = "x";
  sharded.rank_labels = {"a", "b"};
  sharded.timeout_seconds = 1;
  EXPECT_TRUE(AllListedFor("sharded", sharded.ToJson()));
}

TEST(InitInfoFields, EveryListedFieldIsOneItsBackendsParserTakes) {
  for (const std::string& field : InitInfoFieldsOf("nccl")) {
    Result<NcclInitInfo> r = NcclInitInfo::Parse(json{{field, 1}});
    EXPECT_EQ(r.status().message().find("unknown field"), std::string::npos) << field << ": " << r.status().ToString();
  }
  for (const std::string& field : InitInfoFieldsOf("ipc")) {
    json j{{"wsync_ipc_protocol", kIpcProtocolVersion}};
    j[field] = j.contains(field) ? j[field] : json(1);
    Result<IpcInitInfo> r = IpcInitInfo::Parse(j);
    EXPECT_EQ(r.status().message().find("unknown field"), std::string::npos) << field << ": " << r.status().ToString();
  }
  std::vector<std::string> sharded = InitInfoFieldsOf("sharded");
  for (const std::string& f : InitInfoSharedFieldsOf("sharded")) sharded.push_back(f);
  for (const std::string& field : sharded) {
    Result<ShardedInitInfo> r = ShardedInitInfo::Parse(json{{field, 1}});
    EXPECT_EQ(r.status().message().find("unknown field"), std::string::npos) << field << ": " << r.status().ToString();
  }
  for (const std::string& field : InitInfoFieldsOf("delta")) {
    // The delta parser reads each field it knows: a mistyped value is refused naming it.
    Result<delta::DeltaInitRequest> r = delta::ParseDeltaInit(json{{field, json::array()}});
    EXPECT_FALSE(r.ok()) << field;
    EXPECT_NE(r.status().message().find(field), std::string::npos) << field << ": " << r.status().ToString();
  }
}

}  // namespace
}  // namespace wsync
