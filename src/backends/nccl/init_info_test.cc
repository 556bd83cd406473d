#include "backends/nccl/init_info.h"

#include <gtest/gtest.h>

#include <limits>

namespace wsync {
namespace {

using nlohmann::json;

json GlooInit() {
  return json{{"rank_offset", 1}, {"world_size", 3}, {"packed", true},
              {"packed_buffer_size_bytes", 1024}, {"packed_num_buffers", 2},
              {"gloo_store_host", "127.0.0.1"}, {"gloo_store_port", 4000},
              {"gloo_prefix", "p/1"}, {"wsync_protocol", 1}};
}

std::string ErrorOf(const json& j) { return NcclInitInfo::Parse(j).status().message(); }

TEST(NcclInitInfo, RoundTrips) {
  auto info = NcclInitInfo::Parse(GlooInit());
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_TRUE(info->uses_gloo());
  EXPECT_EQ(info->packed_buffer_size_bytes, 1024);
  EXPECT_EQ(NcclInitInfo::Parse(info->ToJson())->ToJson(), info->ToJson());
}

TEST(NcclInitInfo, BroadcastPieceBytesIsAWsyncFieldThatMustBePositive) {
  json j = {{"rank_offset", 1}, {"world_size", 2}, {"nccl_unique_id_b64", std::string(172, 'A')},
            {"wsync_protocol", 1}, {"wsync_broadcast_piece_bytes", int64_t{256} << 20}};
  auto info = NcclInitInfo::Parse(j);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->wsync_broadcast_piece_bytes, int64_t{256} << 20);
  EXPECT_EQ(NcclInitInfo::Parse(info->ToJson())->ToJson(), info->ToJson());
  j["wsync_broadcast_piece_bytes"] = 0;
  EXPECT_EQ(ErrorOf(j), "init_info 'wsync_broadcast_piece_bytes' is 0, outside [1, 1099511627776]");
  // vLLM's payload has no such field: one broadcast per chunk.
  j.erase("wsync_broadcast_piece_bytes");
  EXPECT_FALSE(NcclInitInfo::Parse(j)->wsync_broadcast_piece_bytes.has_value());
}

TEST(NcclInitInfo, DeviceDigestsAreAGpuTrainersWsyncFlag) {
  json j = {{"rank_offset", 1}, {"world_size", 2}, {"nccl_unique_id_b64", std::string(172, 'A')},
            {"wsync_protocol", 1}, {"wsync_device_digests", true}};
  auto info = NcclInitInfo::Parse(j);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_TRUE(info->wsync_device_digests);
  EXPECT_EQ(info->ToJson()["wsync_device_digests"], true);
  j["wsync_device_digests"] = 1;
  EXPECT_EQ(ErrorOf(j), "init_info 'wsync_device_digests' has the wrong type: 1");
  // vLLM's payload has no such field, and a false one is not sent.
  j.erase("wsync_device_digests");
  EXPECT_FALSE(NcclInitInfo::Parse(j)->wsync_device_digests);
  EXPECT_FALSE(NcclInitInfo::Parse(j)->ToJson().contains("wsync_device_digests"));
  // A trainer on the CPU data plane digests on the host.
  json gloo = GlooInit();
  gloo["wsync_device_digests"] = true;
  EXPECT_NE(ErrorOf(gloo).find("wsync_device_digests is for a trainer on a GPU"), std::string::npos) << ErrorOf(gloo);
}

TEST(NcclInitInfo, VllmDefaults) {
  json j = {{"rank_offset", 1}, {"world_size", 5}, {"nccl_unique_id_b64", std::string(172, 'A')}};
  auto info = NcclInitInfo::Parse(j);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_FALSE(info->packed);
  EXPECT_EQ(info->packed_buffer_size_bytes, 1 << 30);
  EXPECT_EQ(info->packed_num_buffers, 2);
  EXPECT_FALSE(info->uses_gloo());
}

TEST(NcclInitInfo, ErrorsNameTheField) {
  json j = GlooInit();
  j.erase("world_size");
  EXPECT_EQ(ErrorOf(j), "init_info is missing 'world_size'");
  j = GlooInit();
  j["packed"] = "yes";
  EXPECT_EQ(ErrorOf(j), "init_info 'packed' has the wrong type: \"yes\"");
  j = GlooInit();
  j["bogus"] = 1;
  EXPECT_EQ(ErrorOf(j), "init_info has unknown field 'bogus'");
  j = GlooInit();
  j["rank_offset"] = 0;
  EXPECT_EQ(ErrorOf(j), "init_info 'rank_offset' is 0, outside [1, 65535]");
  j = GlooInit();
  j["nccl_unique_id_b64"] = "AAAA";
  EXPECT_NE(ErrorOf(j).find("exactly one rendezvous"), std::string::npos);
  j = GlooInit();
  j.erase("gloo_prefix");
  EXPECT_NE(ErrorOf(j).find("gloo_prefix"), std::string::npos);
  j = GlooInit();
  j["master_address"] = "10.0.0.1";
  EXPECT_EQ(ErrorOf(j), kTcpStoreRefusal);
  EXPECT_EQ(std::string(kTcpStoreRefusal),
            "init_info names master_address/master_port: vLLM's TCPStore rendezvous, where the NCCL unique id "
            "is exchanged as a pickled Python object (StatelessProcessGroup.broadcast_obj), and unpickling "
            "network bytes can run arbitrary code, so wsync never joins it. Send the id itself instead: "
            "nccl_unique_id_b64 (standard base64 of the 128-byte ncclUniqueId; vLLM's unique-id mode) for "
            "the GPU data plane, or gloo_store_host/gloo_store_port/gloo_prefix for wsync's CPU data plane "
            "(docs/protocol.md)");
  // vLLM's own TCPStore payload, as its trainer sends it: refused for the same reason.
  EXPECT_EQ(ErrorOf(json{{"master_address", "10.0.0.1"}, {"master_port", 29500}, {"rank_offset", 1},
                         {"world_size", 2}, {"packed", true}}),
            kTcpStoreRefusal);
  EXPECT_EQ(ErrorOf(json{{"master_port", 29500}, {"rank_offset", 1}, {"world_size", 2}}), kTcpStoreRefusal);
  j = GlooInit();
  j["wsync_protocol"] = 9;
  EXPECT_NE(ErrorOf(j).find("wsync_protocol 9"), std::string::npos);
  j = GlooInit();
  j["gloo_rank_labels"] = {"trainer"};
  EXPECT_NE(ErrorOf(j).find("1 entries for world_size 3"), std::string::npos);
}

// Integers are read exactly, then range-checked, before anything is sized by them.
TEST(NcclInitInfo, IntegersAreExactAndRangeChecked) {
  struct Case {
    const char* field;
    json value;
    std::string error;
  };
  const Case cases[] = {
      // 2^32 + 1 must not be read as int (1).
      {"rank_offset", int64_t{4294967297}, "init_info 'rank_offset' is 4294967297, outside [1, 65535]"},
      {"world_size", int64_t{4294967298}, "init_info 'world_size' is 4294967298, outside [2, 65536]"},
      {"world_size", 2147483647, "init_info 'world_size' is 2147483647, outside [2, 65536]"},
      {"world_size", 20000000, "init_info 'world_size' is 20000000, outside [2, 65536]"},
      {"world_size", uint64_t{18446744073709551615u},
       "init_info 'world_size' is 18446744073709551615, outside [2, 65536]"},
      {"world_size", 3.0, "init_info 'world_size' must be an integer in [2, 65536], got 3.0"},
      {"world_size", "3", "init_info 'world_size' must be an integer in [2, 65536], got \"3\""},
      {"gloo_store_port", -7, "init_info 'gloo_store_port' is -7, outside [1, 65535]"},
      {"gloo_store_port", 0, "init_info 'gloo_store_port' is 0, outside [1, 65535]"},
      {"gloo_store_port", 65536, "init_info 'gloo_store_port' is 65536, outside [1, 65535]"},
      {"gloo_store_port", int64_t{4294971296}, "init_info 'gloo_store_port' is 4294971296, outside [1, 65535]"},
      {"packed_num_buffers", int64_t{4294967297}, "init_info 'packed_num_buffers' is 4294967297, outside [1, 1024]"},
      {"packed_buffer_size_bytes", -1, "init_info 'packed_buffer_size_bytes' is -1, outside [1, 1099511627776]"},
      {"wsync_protocol", int64_t{4294967297}, "init_info 'wsync_protocol' is 4294967297"},  // not silently 1
  };
  for (const Case& c : cases) {
    json j = GlooInit();
    j[c.field] = c.value;
    EXPECT_EQ(ErrorOf(j).substr(0, c.error.size()), c.error) << c.field << " = " << c.value.dump();
  }
  json j = GlooInit();
  j["rank_offset"] = 3;  // world_size 3: ranks 0..2
  EXPECT_EQ(ErrorOf(j), "init_info rank_offset 3 must be below world_size 3 (rank 0 is the trainer)");
  j = GlooInit();
  j["world_size"] = 65536;
  j["gloo_store_port"] = 65535;
  EXPECT_TRUE(NcclInitInfo::Parse(j).ok()) << ErrorOf(j);
}

// Text fields are bounded, and a wrong-typed value is shown flat, never dumped.
TEST(NcclInitInfo, TextFieldsAreBoundedAndValuesShownFlat) {
  json j = {{"rank_offset", 1}, {"world_size", 2}, {"nccl_unique_id_b64", std::string(257, 'A')}};
  EXPECT_EQ(ErrorOf(j), "init_info 'nccl_unique_id_b64' must have 1 to 256 characters, got 257");
  j = GlooInit();
  j["gloo_store_host"] = std::string(254, '1');
  EXPECT_EQ(ErrorOf(j), "init_info 'gloo_store_host' must have 1 to 253 characters, got 254");
  json deep = json::array();
  for (int i = 0; i < 60; ++i) deep = json::array({deep});
  j = GlooInit();
  j["gloo_prefix"] = deep;
  EXPECT_EQ(ErrorOf(j), "init_info 'gloo_prefix' has the wrong type: a list of 1 items");
  j = GlooInit();
  j["world_size"] = deep;
  EXPECT_EQ(ErrorOf(j), "init_info 'world_size' must be an integer in [2, 65536], got a list of 1 items");
}

TEST(NcclInitInfo, RankLabelsAreCheckedBeforeTheyAreCopied) {
  json j = GlooInit();
  j["gloo_rank_labels"] = json::array({"a", "b", "c", "d"});
  EXPECT_EQ(ErrorOf(j), "init_info gloo_rank_labels has 4 entries for world_size 3");
  j["gloo_rank_labels"] = json::array({"a", "b", 3});
  EXPECT_NE(ErrorOf(j).find("list of strings"), std::string::npos);
}

TEST(NcclInitInfo, TextFieldsAndTimeoutAreBounded) {
  json j = GlooInit();
  j["gloo_store_host"] = "";
  EXPECT_NE(ErrorOf(j).find("gloo_store_host"), std::string::npos);
  j["gloo_store_host"] = std::string(300, 'a');
  EXPECT_NE(ErrorOf(j).find("gloo_store_host"), std::string::npos);
  j = GlooInit();
  j["gloo_prefix"] = "a b";
  EXPECT_NE(ErrorOf(j).find("gloo_prefix"), std::string::npos);
  j = GlooInit();
  j["timeout_seconds"] = -1;
  EXPECT_NE(ErrorOf(j).find("timeout_seconds"), std::string::npos);
  j["timeout_seconds"] = std::numeric_limits<double>::infinity();
  EXPECT_NE(ErrorOf(j).find("timeout_seconds"), std::string::npos);
  j = GlooInit();
  j[std::string("\xff\xfe")] = 1;  // invalid UTF-8 in a key: named, not thrown
  EXPECT_EQ(ErrorOf(j), "init_info has unknown field '?" "?'");
  EXPECT_EQ(ErrorOf(json::array()), "init_info must be an object");
}

}  // namespace
}  // namespace wsync
