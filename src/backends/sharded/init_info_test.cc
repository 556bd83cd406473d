// The sharded init_info: a valid payload parses and round-trips; every field that is
// missing, mistyped, out of range or inconsistent with another is refused by name.
#include "backends/sharded/init_info.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

namespace wsync {
namespace {

using nlohmann::json;

// Four tensors in two groups, two owner classes over three producers, a fleet of two
// deployments of two workers; this server is the second.
json Init() {
  return json{{"names", {"a", "b", "c", "d"}},
              {"dtype_names", {"bfloat16", "float32", "bfloat16", "bfloat16"}},
              {"shapes", {{4, 8}, {8}, {4, 8}, {2}}},
              {"group_lens", {2, 2}},
              {"owner_sets", {{0, 1}, {2}}},
              {"name_owner_class", {0, 0, 1, 1}},
              {"num_producers", 3},
              {"num_consumers", 4},
              {"workers_per_replica", 2},
              {"replica_rank", 1},
              {"num_replicas", 2},
              {"consumer_offset", 2},
              {"deployment_workers", 2},
              {"plan_digests", {std::string(64, 'a'), std::string(64, '0')}},
              {"world_size", 7},
              {"num_buffers", 3},
              {"gloo_store_host", "127.0.0.1"},
              {"gloo_store_port", 4000},
              {"gloo_prefix", "sharded/1"},
              {"rank_labels", {"t0", "t1", "t2", "w0", "w1", "w2", "w3"}},
              {"timeout_seconds", 30.0},
              {"wsync_protocol", kShardedProtocolVersion}};
}

std::string ErrorOf(const json& j) {
  Result<ShardedInitInfo> r = ShardedInitInfo::Parse(j);
  EXPECT_FALSE(r.ok()) << j.dump();
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  return r.status().message();
}

json With(const char* field, json value) {
  json j = Init();
  j[field] = std::move(value);
  return j;
}

json Without(const char* field) {
  json j = Init();
  j.erase(field);
  return j;
}

TEST(ShardedInitInfo, ParsesEveryFieldAndRoundTrips) {
  Result<ShardedInitInfo> info = ShardedInitInfo::Parse(Init());
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  ASSERT_EQ(info->tensors.size(), 4u);
  EXPECT_EQ(info->tensors[1].name, "b");
  EXPECT_EQ(info->tensors[1].dtype, DType::kF32);
  EXPECT_EQ(info->tensors[0].shape, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(info->group_lens, (std::vector<int>{2, 2}));
  EXPECT_EQ(info->owner_sets, (std::vector<std::vector<int>>{{0, 1}, {2}}));
  EXPECT_EQ(info->name_owner_class, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(info->num_producers, 3);
  EXPECT_EQ(info->num_consumers, 4);
  EXPECT_EQ(info->workers_per_replica, 2);
  EXPECT_EQ(info->replica_rank, 1);
  EXPECT_EQ(info->num_replicas, 2);
  EXPECT_EQ(info->consumer_offset, 2);
  EXPECT_EQ(info->deployment_workers, 2);
  EXPECT_EQ(info->plan_digests[1], std::string(64, '0'));
  EXPECT_EQ(info->num_buffers, 3);
  EXPECT_TRUE(info->uses_gloo());
  EXPECT_EQ(*info->gloo_store_port, 4000);
  EXPECT_EQ(info->rank_labels[4], "w1");
  EXPECT_EQ(*info->timeout_seconds, 30.0);
  EXPECT_EQ(info->RankOf(3), 6);
  EXPECT_EQ(info->ToJson(), Init());
  Result<ShardedInitInfo> again = ShardedInitInfo::Parse(info->ToJson());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->ToJson(), info->ToJson());
}

TEST(ShardedInitInfo, OptionalFieldsTakeTheirDefaults) {
  json j = Init();
  for (const char* f : {"workers_per_replica", "replica_rank", "num_replicas", "num_buffers", "rank_labels",
                        "timeout_seconds"}) {
    j.erase(f);
  }
  Result<ShardedInitInfo> info = ShardedInitInfo::Parse(j);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->workers_per_replica, 0);
  EXPECT_EQ(info->replica_rank, 0);
  EXPECT_EQ(info->num_replicas, 1);
  EXPECT_EQ(info->num_buffers, 2);
  EXPECT_TRUE(info->rank_labels.empty());
  EXPECT_FALSE(info->timeout_seconds.has_value());
}

TEST(ShardedInitInfo, TheNcclRendezvousParsesToo) {
  json j = Init();
  j.erase("gloo_store_host");
  j.erase("gloo_store_port");
  j.erase("gloo_prefix");
  j["nccl_unique_id_b64"] = std::string(172, 'A');
  Result<ShardedInitInfo> info = ShardedInitInfo::Parse(j);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_FALSE(info->uses_gloo());
  EXPECT_FALSE(info->wsync_device_digests);
  EXPECT_EQ(info->ToJson(), j);
  // Ranks on GPUs digest there, and say so.
  j["wsync_device_digests"] = true;
  info = ShardedInitInfo::Parse(j);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_TRUE(info->wsync_device_digests);
  EXPECT_EQ(info->ToJson(), j);
  j["wsync_device_digests"] = "true";
  EXPECT_EQ(ErrorOf(j), "init_info 'wsync_device_digests' must be true or false");
  json gloo = Init();
  gloo["wsync_device_digests"] = true;
  EXPECT_NE(ErrorOf(gloo).find("wsync_device_digests is for trainer ranks on GPUs"), std::string::npos)
      << ErrorOf(gloo);
}

TEST(ShardedInitInfo, SplitDigestsAreAGlooGroupsFlag) {
  json j = Init();
  Result<ShardedInitInfo> info = ShardedInitInfo::Parse(j);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_FALSE(info->wsync_split_digests);
  j["wsync_split_digests"] = true;
  info = ShardedInitInfo::Parse(j);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_TRUE(info->wsync_split_digests);
  EXPECT_EQ(info->ToJson(), j);
  j["wsync_split_digests"] = 1;
  EXPECT_EQ(ErrorOf(j), "init_info 'wsync_split_digests' must be true or false");
  json nccl = Init();
  nccl.erase("gloo_store_host");
  nccl.erase("gloo_store_port");
  nccl.erase("gloo_prefix");
  nccl["nccl_unique_id_b64"] = std::string(172, 'A');
  nccl["wsync_split_digests"] = true;
  EXPECT_NE(ErrorOf(nccl).find("wsync_split_digests is for trainer ranks on the host"), std::string::npos)
      << ErrorOf(nccl);
}

// One range per holder, rows split as evenly as integers allow; small tensors, a single
// holder and fewer rows than holders stay whole.
TEST(SplitDigestRows, OneRangePerHolderOfTensorsOfAtLeastOneMiB) {
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  const TensorMeta embed{"model.embed_tokens.weight", DType::kBF16, {4096, 256}};  // 2 MiB
  EXPECT_EQ(SplitDigestRows(embed, 4), (Ranges{{0, 1024}, {1024, 2048}, {2048, 3072}, {3072, 4096}}));
  EXPECT_EQ(SplitDigestRows(embed, 3), (Ranges{{0, 1365}, {1365, 2730}, {2730, 4096}}));
  EXPECT_EQ(SplitDigestRows(embed, 1), Ranges{});
  const TensorMeta tall{"w", DType::kF32, {10, 65536}};  // 2.5 MiB in 10 rows
  EXPECT_EQ(SplitDigestRows(tall, 4), (Ranges{{0, 2}, {2, 5}, {5, 7}, {7, 10}}));
  EXPECT_EQ(SplitDigestRows(tall, 11), Ranges{});
  const TensorMeta small{"model.layers.0.mlp.up_proj.weight", DType::kBF16, {512, 512}};  // 0.5 MiB
  EXPECT_EQ(SplitDigestRows(small, 4), Ranges{});
  EXPECT_EQ(SplitDigestRows(TensorMeta{"norm", DType::kF32, {kSplitDigestMinBytes / 4}}, 2),
            (Ranges{{0, 131072}, {131072, 262144}}));
}

TEST(ShardedInitInfo, MissingRequiredFieldsAreNamed) {
  for (const char* f : {"names", "dtype_names", "shapes", "group_lens", "owner_sets", "name_owner_class",
                        "num_producers", "num_consumers", "consumer_offset", "deployment_workers", "plan_digests",
                        "world_size", "wsync_protocol"}) {
    EXPECT_EQ(ErrorOf(Without(f)), fmt::format("init_info is missing '{}'", f));
  }
}

TEST(ShardedInitInfo, UnknownFieldsAndOtherShapesAreRefused) {
  EXPECT_EQ(ErrorOf(With("num_rdt_buffers", 2)), "init_info has unknown field 'num_rdt_buffers'");
  EXPECT_EQ(ErrorOf(With(std::string(80, 'x').c_str(), 1)),
            "init_info has unknown field '" + std::string(64, 'x') + "'...");
  EXPECT_EQ(ErrorOf(json::array()), "init_info must be an object");
  EXPECT_EQ(ErrorOf(With("wsync_protocol", 2)), "init_info wsync_protocol 2 is not supported (this server speaks 1)");
}

TEST(ShardedInitInfo, ADegradedGroupNumbersItsLiveConsumersAfterTheProducers) {
  json j = Init();
  j["live_consumers"] = {2, 3};
  j["world_size"] = 5;
  j["rank_labels"] = {"t0", "t1", "t2", "w2", "w3"};
  Result<ShardedInitInfo> parsed = ShardedInitInfo::Parse(j);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const ShardedInitInfo& info = *parsed;
  EXPECT_EQ(info.live_consumers, (std::vector<int>{2, 3}));
  EXPECT_EQ(info.RankOf(2), 3);
  EXPECT_EQ(info.RankOf(3), 4);
  EXPECT_EQ(info.RankOf(0), -1);  // not live: in no group
  EXPECT_EQ(info.ToJson(), j);
  Result<ShardedInitInfo> parsed_whole = ShardedInitInfo::Parse(Init());
  ASSERT_TRUE(parsed_whole.ok()) << parsed_whole.status().ToString();
  const ShardedInitInfo& whole = *parsed_whole;
  EXPECT_EQ(whole.RankOf(0), 3);
  EXPECT_EQ(whole.RankOf(3), 6);
  EXPECT_FALSE(whole.ToJson().contains("live_consumers"));
}

TEST(ShardedInitInfo, IntegersAreExactAndRangeChecked) {
  EXPECT_EQ(ErrorOf(With("num_producers", 0)), "init_info 'num_producers' is 0, outside [1, 65536]");
  EXPECT_EQ(ErrorOf(With("num_consumers", 4294967297)), "init_info 'num_consumers' is 4294967297, outside [1, 65536]");
  EXPECT_EQ(ErrorOf(With("num_producers", 3.0)), "init_info 'num_producers' must be an integer in [1, 65536], got 3.0");
  EXPECT_EQ(ErrorOf(With("num_buffers", 17)), "init_info 'num_buffers' is 17, outside [1, 16]");
  EXPECT_EQ(ErrorOf(With("gloo_store_port", 70000)), "init_info 'gloo_store_port' is 70000, outside [1, 65535]");
  EXPECT_EQ(ErrorOf(With("world_size", 8)), "init_info world_size 8 is not num_producers 3 + num_consumers 4");
  EXPECT_EQ(ErrorOf(With("replica_rank", 2)), "init_info 'replica_rank' is 2, outside [0, 1]");
  // A degraded group: the live consumers' ranks follow each other after the producers.
  EXPECT_EQ(ErrorOf(With("live_consumers", json::array({0, 2}))),
            "init_info world_size 7 is not num_producers 3 + live_consumers 2");
  EXPECT_EQ(ErrorOf(With("live_consumers", json::array({2, 0}))),
            "init_info 'live_consumers' must be ascending without repeats");
  EXPECT_EQ(ErrorOf(With("live_consumers", json::array({0, 4}))), "init_info live_consumers[1] is 4, outside [0, 3]");
  EXPECT_EQ(ErrorOf(With("workers_per_replica", 3)), "init_info workers_per_replica 3 does not divide num_consumers 4");
  EXPECT_EQ(ErrorOf(With("consumer_offset", 4)), "init_info 'consumer_offset' is 4, outside [0, 3]");
  EXPECT_EQ(ErrorOf(With("consumer_offset", 3)),
            "init_info consumer_offset 3 + deployment_workers 2 is past num_consumers 4");
  EXPECT_EQ(ErrorOf(With("consumer_offset", 1)),
            "init_info consumer_offset 1 and deployment_workers 2 disagree with replica_rank 1 and "
            "workers_per_replica 2 (deployments of workers_per_replica workers each)");
  // Deployments of different sizes: workers_per_replica 0, any offset.
  json mixed = With("workers_per_replica", 0);
  mixed["consumer_offset"] = 1;
  mixed["deployment_workers"] = 3;
  mixed["plan_digests"] = {"a", "b", "c"};
  EXPECT_TRUE(ShardedInitInfo::Parse(mixed).ok());
}

TEST(ShardedInitInfo, TheTensorListIsCheckedAsUpdateInfosAre) {
  EXPECT_EQ(ErrorOf(With("names", "a")), "init_info 'names' must be a list");
  EXPECT_EQ(ErrorOf(With("dtype_names", {"bfloat16", "float32", "bfloat16"})),
            "init_info: update_info lists must have equal lengths: names 4, dtype_names 3, shapes 4");
  EXPECT_NE(ErrorOf(With("dtype_names", {"bfloat16", "float99", "bfloat16", "bfloat16"})).find("dtype_names[1] (b)"),
            std::string::npos);
  EXPECT_NE(ErrorOf(With("shapes", {{4, 8}, {-8}, {4, 8}, {2}})).find("shapes[1] (b)"), std::string::npos);
  EXPECT_EQ(ErrorOf(With("names", {"a", "b", "a", "d"})), "init_info names 'a' twice");
  json empty = Init();
  for (const char* f : {"names", "dtype_names", "shapes", "name_owner_class"}) empty[f] = json::array();
  EXPECT_EQ(ErrorOf(empty), "init_info 'names' is empty: the model has no tensors");
}

TEST(ShardedInitInfo, GroupsAndOwnershipMustDescribeTheTensors) {
  EXPECT_EQ(ErrorOf(With("group_lens", {2, 1})), "init_info group_lens add up to 3 tensors; names has 4");
  EXPECT_EQ(ErrorOf(With("group_lens", {2, 0, 2})), "init_info group_lens[1] is 0, outside [1, 4194304]");
  EXPECT_EQ(ErrorOf(With("group_lens", json::array())), "init_info 'group_lens' is empty");
  EXPECT_EQ(ErrorOf(With("group_lens", {1, 1, 1, 1, 1})), "init_info 'group_lens' has 5 entries, more than 4");
  EXPECT_EQ(ErrorOf(With("owner_sets", {{0, 3}})), "init_info owner_sets[0][1] is 3, outside [0, 2]");
  EXPECT_EQ(ErrorOf(With("owner_sets", {{1, 0}, {2}})),
            "init_info owner_sets[0] must list distinct ranks in ascending order");
  EXPECT_EQ(ErrorOf(With("owner_sets", {{0}, json::array()})),
            "init_info owner_sets[1] must be a list of 1 to 3 producer ranks (num_producers)");
  EXPECT_EQ(ErrorOf(With("owner_sets", json::array())), "init_info 'owner_sets' is empty");
  EXPECT_EQ(ErrorOf(With("name_owner_class", {0, 0, 1, 2})), "init_info name_owner_class[3] is 2, outside [0, 1]");
  EXPECT_EQ(ErrorOf(With("name_owner_class", {0, 0, 1})), "init_info name_owner_class has 3 entries for 4 names");
}

TEST(ShardedInitInfo, TensorPartsRoundTripAndAreRangeChecked) {
  // Tensor 0 ("a", 4 rows) split between the two classes; tensor 2 at row 3.
  json j = With("tensor_parts", {{0, 0, 2, 0}, {0, 2, 4, 1}, {2, 0, 3, 1}, {2, 3, 4, 0}});
  Result<ShardedInitInfo> info = ShardedInitInfo::Parse(j);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  ASSERT_EQ(info->tensor_parts.size(), 4u);
  EXPECT_EQ(info->tensor_parts[0], (std::vector<TensorPart>{{0, 2, 0}, {2, 4, 1}}));
  EXPECT_TRUE(info->tensor_parts[1].empty());
  EXPECT_EQ(info->tensor_parts[2], (std::vector<TensorPart>{{0, 3, 1}, {3, 4, 0}}));
  EXPECT_EQ(info->ToJson(), j);
  EXPECT_FALSE(ShardedInitInfo::Parse(Init())->ToJson().contains("tensor_parts"));
  EXPECT_NE(ErrorOf(With("tensor_parts", {{0, 0, 2}})).find("tensor_parts[0] must be"), std::string::npos);
  EXPECT_NE(ErrorOf(With("tensor_parts", {{4, 0, 2, 0}})).find("tensor_parts[0]"), std::string::npos);
  EXPECT_NE(ErrorOf(With("tensor_parts", {{0, 2, 2, 0}})).find("tensor_parts[0]"), std::string::npos);
  EXPECT_NE(ErrorOf(With("tensor_parts", {{0, 0, 2, 2}})).find("tensor_parts[0]"), std::string::npos);
  EXPECT_NE(ErrorOf(With("tensor_parts", {{2, 0, 4, 0}, {0, 0, 4, 0}})).find("out of tensor order"),
            std::string::npos);
  EXPECT_NE(ErrorOf(With("tensor_parts", 3)).find("'tensor_parts' must be a list"), std::string::npos);
}

TEST(ShardedInitInfo, PlanDigestsLabelsAndRendezvousAreChecked) {
  EXPECT_EQ(ErrorOf(With("plan_digests", {"aa"})), "init_info plan_digests has 1 entries for deployment_workers 2");
  EXPECT_EQ(ErrorOf(With("plan_digests", {"aa", "not hex"})), "init_info plan_digests[1] must be a hex digest");
  EXPECT_EQ(ErrorOf(With("plan_digests", {"aa", 5})), "init_info plan_digests[1] must be a hex digest");
  EXPECT_EQ(ErrorOf(With("rank_labels", {"t0"})), "init_info rank_labels has 1 entries for world_size 7");
  EXPECT_EQ(ErrorOf(With("timeout_seconds", -1)), "init_info timeout_seconds must be a positive finite number");
  EXPECT_EQ(ErrorOf(Without("gloo_prefix")),
            "init_info needs all of gloo_store_host, gloo_store_port and gloo_prefix");
  EXPECT_EQ(ErrorOf(With("nccl_unique_id_b64", "AAAA")),
            "init_info needs exactly one rendezvous: nccl_unique_id_b64 (GPU) or gloo_store_host (CPU)");
  EXPECT_EQ(ErrorOf(With("gloo_store_host", "a b")),
            "init_info 'gloo_store_host' must be printable ASCII without spaces");
}

}  // namespace
}  // namespace wsync

namespace wsync {
namespace {

// An adapter group's init (a LoRA trainer's): no model, no plan.
json AdapterInit() {
  json j = Init();
  for (const char* field : {"names", "dtype_names", "shapes", "group_lens", "owner_sets", "name_owner_class",
                            "plan_digests"}) {
    j.erase(field);
  }
  j["wsync_lora"] = true;
  return j;
}

TEST(ShardedInitInfo, AnAdapterGroupCarriesNoModelAndRoundTrips) {
  Result<ShardedInitInfo> info = ShardedInitInfo::Parse(AdapterInit());
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_TRUE(info->adapters_only);
  EXPECT_TRUE(info->tensors.empty());
  EXPECT_TRUE(info->plan_digests.empty());
  EXPECT_EQ(info->RankOf(3), 6);
  EXPECT_EQ(info->ToJson(), AdapterInit());
  // A model group never says wsync_lora.
  EXPECT_FALSE(ShardedInitInfo::Parse(Init())->ToJson().contains("wsync_lora"));
}

TEST(ShardedInitInfo, AnAdapterGroupRefusesModelFieldsAndANonBoolean) {
  for (const char* field : {"names", "group_lens", "owner_sets", "plan_digests", "tensor_parts"}) {
    json j = AdapterInit();
    j[field] = json::array();
    EXPECT_EQ(ErrorOf(j), fmt::format("init_info '{}': an adapter group (wsync_lora) carries no model", field));
  }
  json j = AdapterInit();
  j["wsync_lora"] = 1;
  EXPECT_EQ(ErrorOf(j), "init_info 'wsync_lora' must be true or false");
  // wsync_lora false is a model group: its model is required.
  j["wsync_lora"] = false;
  EXPECT_EQ(ErrorOf(j), "init_info is missing 'names'");
}

TEST(ShardedLoraBuckets, PacksInOrderUpToTheCapWithALargeTensorAlone) {
  auto meta = [](const char* name, int64_t bytes) {
    return TensorMeta{name, DType::kU8, {bytes}};
  };
  const int64_t cap = static_cast<int64_t>(kShardedLoraBucketBytes);
  std::vector<TensorMeta> t = {meta("a", cap / 2), meta("b", cap / 2), meta("c", 1), meta("d", cap + 1),
                               meta("e", 7)};
  std::vector<LoraBucket> b = ShardedLoraBuckets(t);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(std::tie(b[0].first, b[0].end, b[0].bytes), std::make_tuple(size_t{0}, size_t{2}, size_t(cap)));
  EXPECT_EQ(std::tie(b[1].first, b[1].end, b[1].bytes), std::make_tuple(size_t{2}, size_t{3}, size_t{1}));
  EXPECT_EQ(std::tie(b[2].first, b[2].end, b[2].bytes), std::make_tuple(size_t{3}, size_t{4}, size_t(cap + 1)));
  EXPECT_EQ(std::tie(b[3].first, b[3].end, b[3].bytes), std::make_tuple(size_t{4}, size_t{5}, size_t{7}));
  EXPECT_TRUE(ShardedLoraBuckets({}).empty());
}

}  // namespace
}  // namespace wsync
