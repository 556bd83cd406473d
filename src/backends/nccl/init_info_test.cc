#include "backends/nccl/init_info.h"

#include <gtest/gtest.h>

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
  EXPECT_EQ(ErrorOf(j), "init_info wsync_broadcast_piece_bytes must be positive");
  // vLLM's payload has no such field: one broadcast per chunk.
  j.erase("wsync_broadcast_piece_bytes");
  EXPECT_FALSE(NcclInitInfo::Parse(j)->wsync_broadcast_piece_bytes.has_value());
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
  EXPECT_NE(ErrorOf(j).find("rank_offset 0 must be >= 1"), std::string::npos);
  j = GlooInit();
  j["nccl_unique_id_b64"] = "AAAA";
  EXPECT_NE(ErrorOf(j).find("exactly one rendezvous"), std::string::npos);
  j = GlooInit();
  j.erase("gloo_prefix");
  EXPECT_NE(ErrorOf(j).find("gloo_prefix"), std::string::npos);
  j = GlooInit();
  j["master_address"] = "10.0.0.1";
  EXPECT_NE(ErrorOf(j).find("TCPStore"), std::string::npos);
  j = GlooInit();
  j["wsync_protocol"] = 9;
  EXPECT_NE(ErrorOf(j).find("wsync_protocol 9"), std::string::npos);
  j = GlooInit();
  j["gloo_rank_labels"] = {"trainer"};
  EXPECT_NE(ErrorOf(j).find("1 entries for world_size 3"), std::string::npos);
}

}  // namespace
}  // namespace wsync
