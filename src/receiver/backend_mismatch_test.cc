// Backend mismatch: an init_info of another backend is named with both backends, the
// field that gave it away and the way out; an init_info of the server's own backend, or
// one no backend claims, is left to the backend's parser.
#include "receiver/backend_mismatch.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace wsync {
namespace {

using nlohmann::json;

// What each wsync trainer sends (field names only matter here).
json NcclInit() {
  return json{{"world_size", 3}, {"rank_offset", 1}, {"packed", true}, {"gloo_store_host", "127.0.0.1"},
              {"gloo_store_port", 29500}, {"gloo_prefix", "p"}, {"wsync_protocol", 2}};
}
json IpcInit() {
  return json{{"wsync_ipc_protocol", 3}, {"packed", true}, {"session", "s"}, {"control_path", "/wsync-x"},
              {"control_bytes", 4096}, {"num_slots", 2}, {"slot_bytes", 1 << 20}, {"reader_offset", 0},
              {"reader_count", 1}, {"buffers", json::object()}};
}
json DeltaInit() { return json{{"sync_dir", "/sync"}, {"format_version", 1}}; }
// The sharded trainer's: its own fields and the nccl backend's rendezvous fields.
json ShardedInit() {
  return json{{"names", {"a"}}, {"dtype_names", {"float32"}}, {"shapes", {{2}}}, {"group_lens", {1}},
              {"owner_sets", {{0}}}, {"name_owner_class", {0}}, {"num_producers", 1}, {"num_consumers", 1},
              {"consumer_offset", 0}, {"deployment_workers", 1}, {"plan_digests", {"ab"}}, {"world_size", 2},
              {"num_buffers", 2}, {"gloo_store_host", "127.0.0.1"}, {"gloo_store_port", 29500},
              {"gloo_prefix", "p"}, {"wsync_protocol", 1}, {"timeout_seconds", 5}};
}
// vLLM's NCCL engine's init_info (torch TCPStore rendezvous).
json VllmNcclInit() {
  return json{{"master_address", "10.0.0.1"}, {"master_port", 29500}, {"rank_offset", 1}, {"world_size", 2}};
}

TEST(BackendMismatch, AnIpcInitInfoToAnNcclServerNamesBothBackendsAndTheField) {
  Status s = CheckInitInfoBackend("nccl", IpcInit());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "this server runs backend 'nccl'; the init_info is for backend 'ipc' (field 'buffers'): "
            "start the server with --backend ipc or push with --backend nccl");
}

TEST(BackendMismatch, EveryPairOfDifferentBackendsIsNamed) {
  const std::pair<std::string, json> inits[] = {
      {"nccl", NcclInit()}, {"nccl", VllmNcclInit()}, {"ipc", IpcInit()}, {"delta", DeltaInit()},
      {"sharded", ShardedInit()}};
  for (const auto& [sent_for, init] : inits) {
    for (const std::string& server : InitInfoBackends()) {
      Status s = CheckInitInfoBackend(server, init);
      if (server == sent_for) {
        EXPECT_TRUE(s.ok()) << server << " <- " << init.dump() << ": " << s.ToString();
        continue;
      }
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << server << " <- " << init.dump();
      EXPECT_NE(s.message().find("this server runs backend '" + server + "'; the init_info is for backend '" +
                                 sent_for + "'"),
                std::string::npos)
          << s.message();
      std::optional<InitInfoGuess> guess = GuessForeignInitInfo(server, init);
      ASSERT_TRUE(guess.has_value());
      EXPECT_EQ(guess->backend, sent_for);
      EXPECT_TRUE(init.contains(guess->field)) << guess->field;
    }
  }
}

TEST(BackendMismatch, TheFirstForeignFieldInKeyOrderIsNamed) {
  // nlohmann's object keeps keys sorted: "format_version" comes before "sync_dir".
  EXPECT_EQ(GuessForeignInitInfo("nccl", DeltaInit())->field, "format_version");
  EXPECT_EQ(GuessForeignInitInfo("delta", VllmNcclInit())->field, "master_address");
}

TEST(BackendMismatch, AnInitInfoWithAFieldOfTheServersBackendGoesToItsParser) {
  json mixed = IpcInit();
  mixed["world_size"] = 2;  // one nccl field: the ipc parser names it as unknown
  EXPECT_TRUE(CheckInitInfoBackend("ipc", mixed).ok());
  json nccl = NcclInit();
  nccl["buffers"] = json::object();
  EXPECT_TRUE(CheckInitInfoBackend("nccl", nccl).ok());
}

TEST(BackendMismatch, InitInfosNoBackendClaimsGoToTheParser) {
  for (const json& j : {json::object(), json{{"packed", true}, {"timeout_seconds", 5}}, json{{"bogus", 1}},
                        json(5), json::array({1, 2}), json(nullptr), json("buffers")}) {
    for (const std::string& server : InitInfoBackends()) {
      EXPECT_TRUE(CheckInitInfoBackend(server, j).ok()) << server << " <- " << j.dump();
    }
  }
}

TEST(BackendMismatch, TheMostFieldsWinBetweenTwoForeignBackends) {
  json j = IpcInit();
  j["sync_dir"] = "/sync";  // one delta field against nine ipc fields
  EXPECT_EQ(GuessForeignInitInfo("nccl", j)->backend, "ipc");
}

TEST(BackendMismatch, AServerOfABackendNotInTheTableStillNamesKnownInitInfos) {
  Status s = CheckInitInfoBackend("future", DeltaInit());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("this server runs backend 'future'; the init_info is for backend 'delta'"),
            std::string::npos)
      << s.message();
  EXPECT_TRUE(InitInfoFieldsOf("future").empty());
}

TEST(BackendMismatch, FieldsShardedSharesWithNcclDoNotHideItFromAnNcclServer) {
  // The sharded init_info carries nccl's rendezvous fields, but they are sharded's too.
  Status s = CheckInitInfoBackend("nccl", ShardedInit());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "this server runs backend 'nccl'; the init_info is for backend 'sharded' (field 'consumer_offset'): "
            "start the server with --backend sharded or push with --backend nccl");
  // An nccl init_info names nccl at a sharded server, by a field sharded does not send.
  std::optional<InitInfoGuess> guess = GuessForeignInitInfo("sharded", NcclInit());
  ASSERT_TRUE(guess.has_value());
  EXPECT_EQ(guess->backend, "nccl");
  EXPECT_EQ(guess->field, "gloo_prefix");  // the first nccl field in key order
  // A field only nccl sends, beside sharded's own, goes to the sharded parser.
  json mixed = ShardedInit();
  mixed["rank_offset"] = 1;
  EXPECT_TRUE(CheckInitInfoBackend("sharded", mixed).ok());
  for (const std::string& f : InitInfoSharedFieldsOf("sharded")) {
    const std::vector<std::string>& nccl = InitInfoFieldsOf("nccl");
    EXPECT_NE(std::find(nccl.begin(), nccl.end(), f), nccl.end()) << f << " is shared but listed for no backend";
  }
}

}  // namespace
}  // namespace wsync
