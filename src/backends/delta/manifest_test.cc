#include "backends/delta/manifest.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace wsync::delta {
namespace {

DeltaManifest Sample() {
  DeltaManifest m;
  m.version = 7;
  m.base_version = 6;
  DeltaTensorRecord r;
  r.name = "model.layers.0.mlp.up_proj.weight";
  r.dtype = DType::kBF16;
  r.shape = {3072, 1024};
  r.uncompressed_num_bytes = 3072 * 1024 * 2;
  r.compressed_num_bytes = 12345;
  r.payload_file = PayloadFileName(0, 0);
  r.payload_key = r.name;
  r.checksum = "00112233445566778899aabbccddeeff";
  m.tensors.push_back(r);
  m.total_uncompressed_num_bytes = r.uncompressed_num_bytes;
  m.total_compressed_num_bytes = r.compressed_num_bytes;
  m.payload_files = {r.payload_file};
  return m;
}

// A full version's base_digest: written last and only when set, read back, and refused
// unless it is 32 lowercase hex digits; a manifest without it (SkyRL's) has none.
TEST(DeltaManifestTest, BaseDigestRoundTripsAndIsChecked) {
  DeltaManifest m = Sample();
  m.base_version = 0;
  m.version = 1;
  EXPECT_FALSE(nlohmann::json::parse(m.ToJson()).contains("base_digest"));
  EXPECT_TRUE(DeltaManifest::Parse(m.ToJson())->base_digest.empty());
  m.base_digest = "0123456789abcdef0123456789abcdef";
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(m.ToJson());
  EXPECT_EQ(std::prev(j.end()).key(), "base_digest");
  EXPECT_EQ(j["base_digest"], m.base_digest);
  auto back = DeltaManifest::Parse(m.ToJson());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->base_digest, m.base_digest);
  for (const nlohmann::json& bad : {nlohmann::json(42), nlohmann::json(""), nlohmann::json(std::string(31, 'a')),
                                    nlohmann::json(std::string(33, 'a')), nlohmann::json("0123456789ABCDEF0123456789abcdef"),
                                    nlohmann::json("0123456789abcdeg0123456789abcdef"), nlohmann::json(nullptr)}) {
    nlohmann::json t = nlohmann::json::parse(m.ToJson());
    t["base_digest"] = bad;
    auto r = DeltaManifest::Parse(t.dump());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad.dump();
    EXPECT_NE(r.status().message().find("base_digest"), std::string::npos) << r.status().message();
  }
}

TEST(DeltaManifestTest, NamesFollowSkyRL) {
  EXPECT_EQ(VersionDirName(7), "delta-00000007");
  EXPECT_EQ(VersionDir("/sync", 12), "/sync/delta-00000012");
  EXPECT_EQ(PayloadFileName(0, 3), "delta-rank00000-file000003.safetensors");
}

TEST(DeltaManifestTest, JsonHasSkyRLKeysInOrderAndRoundTrips) {
  DeltaManifest m = Sample();
  std::string text = m.ToJson();
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(text);
  std::vector<std::string> keys;
  for (const auto& [k, _] : j.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"version", "base_version", "tensors", "total_uncompressed_num_bytes",
                                            "total_compressed_num_bytes", "payload_files", "format_version"}));
  std::vector<std::string> record_keys;
  for (const auto& [k, _] : j["tensors"][0].items()) record_keys.push_back(k);
  EXPECT_EQ(record_keys, (std::vector<std::string>{"name", "dtype", "shape", "uncompressed_num_bytes",
                                                   "compressed_num_bytes", "payload_file", "payload_key", "checksum",
                                                   "checksum_algorithm"}));
  EXPECT_EQ(j["tensors"][0]["dtype"], "bfloat16");
  EXPECT_EQ(j["tensors"][0]["checksum_algorithm"], "xxh3-128");
  auto back = DeltaManifest::Parse(text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->version, 7);
  EXPECT_EQ(back->base_version, 6);
  ASSERT_EQ(back->tensors.size(), 1u);
  EXPECT_EQ(back->tensors[0].shape, (Shape{3072, 1024}));
  EXPECT_EQ(back->tensors[0].checksum, m.tensors[0].checksum);
  EXPECT_EQ(back->payload_files, m.payload_files);
}

TEST(DeltaManifestTest, ReadsSkyRLManifestsIncludingTheLegacySha256Field) {
  // As SkyRL's json.dumps(asdict(manifest)) writes it; no format_version.
  std::string skyrl = R"({"version": 2, "base_version": 1, "tensors": [
    {"name": "a", "dtype": "float32", "shape": [4], "uncompressed_num_bytes": 16,
     "compressed_num_bytes": 9, "payload_file": "delta-rank00000-file000000.safetensors",
     "payload_key": "a", "checksum": "ff", "checksum_algorithm": "xxh3-128"},
    {"name": "b", "dtype": "bfloat16", "shape": [2], "uncompressed_num_bytes": 4,
     "compressed_num_bytes": 9, "payload_file": "delta-rank00000-file000000.safetensors",
     "payload_key": "b", "sha256": "ee"}],
    "total_uncompressed_num_bytes": 20, "total_compressed_num_bytes": 18,
    "payload_files": ["delta-rank00000-file000000.safetensors"]})";
  auto m = DeltaManifest::Parse(skyrl);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->format_version, 1);
  EXPECT_EQ(m->tensors[0].dtype, DType::kF32);
  EXPECT_EQ(m->tensors[1].checksum_algorithm, DigestAlgorithm::kSha256);
  EXPECT_EQ(m->tensors[1].checksum, "ee");
  // An empty delta: no tensors, no files.
  auto empty = DeltaManifest::Parse(R"({"version": 1, "base_version": 0, "tensors": [], "payload_files": []})");
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->tensors.empty());
}

TEST(DeltaManifestTest, BadManifestsNameTheField) {
  auto future = DeltaManifest::Parse(R"({"version": 1, "base_version": 0, "format_version": 99})");
  EXPECT_EQ(future.status().code(), StatusCode::kFailedPrecondition);
  auto no_version = DeltaManifest::Parse(R"({"base_version": 0})");
  EXPECT_NE(no_version.status().message().find("'version'"), std::string::npos);
  nlohmann::json j = nlohmann::json::parse(Sample().ToJson());
  j["tensors"][0].erase("payload_key");
  auto missing = DeltaManifest::Parse(j.dump());
  EXPECT_NE(missing.status().message().find("up_proj"), std::string::npos) << missing.status().message();
  j = nlohmann::json::parse(Sample().ToJson());
  j["tensors"][0]["payload_file"] = "../escape.safetensors";
  j["payload_files"] = {"../escape.safetensors"};
  EXPECT_EQ(DeltaManifest::Parse(j.dump()).status().code(), StatusCode::kInvalidArgument);
  j = nlohmann::json::parse(Sample().ToJson());
  j["payload_files"] = nlohmann::json::array();
  EXPECT_EQ(DeltaManifest::Parse(j.dump()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(DeltaManifest::Parse("not json").ok());
}

// Hostile manifests: payload_files may only name plain files of the version
// directory; numbers are range-checked, never truncated; no field of a wrong type throws.
TEST(DeltaManifestTest, HostileManifestsAreRefused) {
  nlohmann::json j = nlohmann::json::parse(Sample().ToJson());
  for (const char* bad : {"../../etc/passwd", "/etc/passwd", "..", ".", "", "a/b", ".hidden"}) {
    nlohmann::json m = j;
    m["payload_files"].push_back(bad);
    auto r = DeltaManifest::Parse(m.dump());
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  nlohmann::json m = j;
  m["tensors"][0]["name"] = std::string(2000, 'x');  // would make every message about it 2 KB
  EXPECT_EQ(DeltaManifest::Parse(m.dump()).status().code(), StatusCode::kInvalidArgument);
  m = j;
  m["payload_files"].push_back(std::string(300, 'f'));  // over NAME_MAX
  EXPECT_EQ(DeltaManifest::Parse(m.dump()).status().code(), StatusCode::kInvalidArgument);
  m = j;
  m["format_version"] = 4294967297ULL;  // 2^32 + 1: not version 1
  EXPECT_EQ(DeltaManifest::Parse(m.dump()).status().code(), StatusCode::kFailedPrecondition);
  m = j;
  m["version"] = 18446744073709551615ULL;
  EXPECT_EQ(DeltaManifest::Parse(m.dump()).status().code(), StatusCode::kInvalidArgument);
  m = j;
  m["tensors"].push_back(m["tensors"][0]);  // the same tensor twice: two threads would patch it at once
  EXPECT_EQ(DeltaManifest::Parse(m.dump()).status().code(), StatusCode::kInvalidArgument);
  m = j;
  m["tensors"][0]["shape"] = {uint64_t{1} << 62, 8};  // byte size past 2^64
  EXPECT_EQ(DeltaManifest::Parse(m.dump()).status().code(), StatusCode::kInvalidArgument);
  for (const char* key : {"name", "dtype", "shape", "uncompressed_num_bytes", "payload_file", "checksum"}) {
    for (const nlohmann::json& v : {nlohmann::json(nullptr), nlohmann::json(1.5), nlohmann::json::array(),
                                    nlohmann::json::object(), nlohmann::json(-1), nlohmann::json("x")}) {
      nlohmann::json t = j;
      t["tensors"][0][key] = v;
      (void)DeltaManifest::Parse(t.dump());  // an error or a manifest, never an exception
    }
  }
  for (const char* key : {"version", "base_version", "tensors", "payload_files", "total_compressed_num_bytes"}) {
    for (const nlohmann::json& v : {nlohmann::json(nullptr), nlohmann::json(1.5), nlohmann::json::array({1}),
                                    nlohmann::json::object(), nlohmann::json(-1), nlohmann::json("x")}) {
      nlohmann::json t = j;
      t[key] = v;
      (void)DeltaManifest::Parse(t.dump());
    }
  }
}

// A manifest nested 100,000 deep is refused before parsing, naming the field.
TEST(DeltaManifestTest, DeepNestingIsRefused) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  auto r = DeltaManifest::Parse(R"({"version": 1, "base_version": 0, "tensors": )" + deep + "}");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "manifest: field 'tensors' nests deeper than 64 levels");
  // 63 levels under the top object parse (and are then refused as a field of the wrong type).
  const std::string deepest = std::string(63, '[') + std::string(63, ']');
  r = DeltaManifest::Parse(R"({"version": 1, "base_version": 0, "tensors": [], "payload_files": )" + deepest + "}");
  EXPECT_EQ(r.status().message(), "payload_files[0] is not a string");
}

}  // namespace
}  // namespace wsync::delta
