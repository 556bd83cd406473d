#include "format/safetensors.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace wsync {
namespace {

namespace fs = std::filesystem;

std::vector<std::byte> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  std::memcpy(out.data(), c.data(), c.size());
  return out;
}

void WriteBytes(const std::string& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A file with the given header text (length prefix added) and `data_size` data bytes.
void WriteRaw(const std::string& path, const std::string& header, size_t data_size) {
  std::vector<std::byte> bytes(8 + header.size() + data_size, std::byte{0x5a});
  for (int i = 0; i < 8; ++i) bytes[i] = std::byte((header.size() >> (8 * i)) & 0xff);
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  WriteBytes(path, bytes);
}

// A tensor with deterministic contents whose storage the test owns.
HostTensor Filled(std::string name, DType dtype, Shape shape, uint8_t salt) {
  HostTensor t = *HostTensor::Zeros({std::move(name), dtype, std::move(shape)});
  auto s = t.storage.span();
  for (size_t i = 0; i < t.meta.nbytes(); ++i) {
    uint8_t v = static_cast<uint8_t>(i * 37 + salt * 11 + 1);
    s[i] = std::byte(dtype == DType::kBool ? (v & 1) : v);
  }
  return t;
}

std::vector<TensorRef> Refs(const std::vector<HostTensor>& ts) {
  std::vector<TensorRef> r;
  for (const auto& t : ts) r.push_back(t.ref());
  return r;
}

bool SameBytes(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/wsync_fmt_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  // Opens `path`, expecting failure with `code` and every one of `needles` in the message.
  void ExpectOpenError(const std::string& path, StatusCode code, std::vector<std::string> needles) {
    auto f = SafetensorsFile::Open(path);
    ASSERT_FALSE(f.ok());
    EXPECT_EQ(f.status().code(), code) << f.status().ToString();
    for (const auto& n : needles) {
      EXPECT_NE(f.status().message().find(n), std::string::npos)
          << "'" << n << "' not in: " << f.status().message();
    }
  }

  std::string dir_;
};

TEST_F(SafetensorsTest, RoundTripEveryDType) {
  std::vector<HostTensor> ts;
  const DType all[] = {DType::kBool, DType::kU8,  DType::kI8,   DType::kI16,
                       DType::kI32,  DType::kI64, DType::kF16,  DType::kBF16,
                       DType::kF32,  DType::kF64, DType::kF8E4M3, DType::kF8E5M2};
  uint8_t salt = 0;
  for (DType d : all) {
    ts.push_back(Filled(std::string("t.") + std::string(SafetensorsName(d)), d, {3, 5}, salt++));
  }
  ts.push_back(Filled("scalar", DType::kF32, {}, salt++));
  ts.push_back(Filled("empty", DType::kBF16, {0, 4}, salt++));
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "7"}};
  const std::string path = Path("all.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, Refs(ts), meta).ok());
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->metadata(), meta);
  ASSERT_EQ(f->tensors().size(), ts.size());
  for (const HostTensor& t : ts) {
    auto bytes = f->Bytes(t.meta.name);
    ASSERT_TRUE(bytes.ok()) << t.meta.name;
    EXPECT_TRUE(SameBytes(*bytes, t.storage.span().first(t.meta.nbytes()))) << t.meta.name;
    // Largest-item-first layout keeps every tensor aligned to its item size.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(bytes->data()) % ItemSize(t.meta.dtype), 0u) << t.meta.name;
    auto it = std::find_if(f->tensors().begin(), f->tensors().end(),
                           [&](const TensorMeta& m) { return m.name == t.meta.name; });
    ASSERT_NE(it, f->tensors().end());
    EXPECT_EQ(*it, t.meta);
  }
  // tensors() is in data-offset order.
  for (size_t i = 1; i < f->tensors().size(); ++i) {
    EXPECT_LE(f->BytesAt(i - 1).data() + f->BytesAt(i - 1).size(), f->BytesAt(i).data());
  }
  auto missing = f->Bytes("nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope"), std::string::npos);

  // The raw layout: header length is a multiple of 8, padded with spaces, valid JSON.
  auto raw = ReadAll(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(raw[i]);
  EXPECT_EQ(n % 8, 0u);
  std::string header(reinterpret_cast<const char*>(raw.data() + 8), n);
  auto j = nlohmann::json::parse(header);
  EXPECT_EQ(j["__metadata__"]["step"], "7");
  EXPECT_EQ(j["t.F8_E4M3"]["dtype"], "F8_E4M3");
  EXPECT_EQ(j["t.F8_E4M3"]["shape"], nlohmann::json({3, 5}));
}

TEST_F(SafetensorsTest, Fp8E4M3BytesSurviveExactly) {
  HostTensor t = *HostTensor::Zeros({"w8", DType::kF8E4M3, {256}});
  for (int i = 0; i < 256; ++i) t.storage.data()[i] = std::byte(i);  // every code, NaNs included
  const std::string path = Path("fp8.safetensors");
  std::vector<TensorRef> refs = {t.ref()};
  ASSERT_TRUE(WriteSafetensors(path, refs).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE(f->metadata().empty());
  EXPECT_TRUE(SameBytes(*f->Bytes("w8"), t.storage.span()));
  EXPECT_EQ(f->tensors()[0].dtype, DType::kF8E4M3);
}

// Bytes exactly as Python's safetensors.torch.save_file({"a": f32 [1., 2.],
// "b": bf16 [[1., -2.], [.5, 0.]]}, path, metadata={"format": "pt"}) lays them out:
// compact JSON, metadata first, F32 before BF16, header padded with spaces to 8.
const char kPythonHeader[] =
    "{\"__metadata__\":{\"format\":\"pt\"},"
    "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
    "\"b\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[8,16]}}  ";
const uint8_t kPythonLength[8] = {0x90, 0, 0, 0, 0, 0, 0, 0};  // 144
const uint8_t kPythonData[16] = {0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0x40,   // a
                                 0x80, 0x3f, 0x00, 0xc0, 0x00, 0x3f, 0x00, 0x00};  // b

std::vector<std::byte> PythonFixture() {
  std::vector<std::byte> out;
  for (uint8_t b : kPythonLength) out.push_back(std::byte(b));
  for (size_t i = 0; i + 1 < sizeof(kPythonHeader); ++i) out.push_back(std::byte(kPythonHeader[i]));
  for (uint8_t b : kPythonData) out.push_back(std::byte(b));
  return out;
}

TEST_F(SafetensorsTest, ReadsPythonWrittenFile) {
  ASSERT_EQ(sizeof(kPythonHeader) - 1, 144u);
  const std::string path = Path("py.safetensors");
  WriteBytes(path, PythonFixture());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->tensors().size(), 2u);
  EXPECT_EQ(f->tensors()[0], (TensorMeta{"a", DType::kF32, {2}}));
  EXPECT_EQ(f->tensors()[1], (TensorMeta{"b", DType::kBF16, {2, 2}}));
  EXPECT_EQ(f->metadata().at("format"), "pt");
  float a[2];
  std::memcpy(a, f->Bytes("a")->data(), 8);
  EXPECT_EQ(a[0], 1.0f);
  EXPECT_EQ(a[1], 2.0f);
  uint16_t b[4];
  std::memcpy(b, f->Bytes("b")->data(), 8);
  EXPECT_EQ(b[0], 0x3f80);
  EXPECT_EQ(b[1], 0xc000);
  EXPECT_EQ(b[2], 0x3f00);
  EXPECT_EQ(b[3], 0x0000);
}

TEST_F(SafetensorsTest, WritesByteIdenticalToPython) {
  // Given in the "wrong" order: the writer must still put F32 first, like the reference.
  HostTensor b = *HostTensor::Zeros({"b", DType::kBF16, {2, 2}});
  HostTensor a = *HostTensor::Zeros({"a", DType::kF32, {2}});
  std::memcpy(a.storage.data(), kPythonData, 8);
  std::memcpy(b.storage.data(), kPythonData + 8, 8);
  std::vector<TensorRef> refs = {b.ref(), a.ref()};
  const std::string path = Path("ours.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, refs, {{"format", "pt"}}).ok());
  EXPECT_EQ(ReadAll(path), PythonFixture());
}

TEST_F(SafetensorsTest, WriterRejectsBadTensors) {
  HostTensor a = Filled("a", DType::kF32, {2}, 1);
  TensorRef short_ref = a.ref();
  short_ref.bytes = short_ref.bytes.first(4);
  std::vector<TensorRef> refs = {short_ref};
  Status s = WriteSafetensors(Path("x.safetensors"), refs);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("tensor a has 4 bytes"), std::string::npos) << s.message();

  refs = {a.ref(), a.ref()};
  s = WriteSafetensors(Path("x.safetensors"), refs);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("appears twice"), std::string::npos) << s.message();
  EXPECT_FALSE(fs::exists(Path("x.safetensors")));
  EXPECT_FALSE(fs::exists(Path("x.safetensors.tmp")));

  const int64_t negative[] = {-2, -1};
  TensorRef neg = a.ref();
  neg.shape = negative;  // numel 2, matching the bytes, but not a shape
  s = WriteSafetensors(Path("x.safetensors"), std::vector<TensorRef>{neg});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("negative dimension"), std::string::npos) << s.message();

  s = WriteSafetensors(Path("no/such/dir/x.safetensors"), std::vector<TensorRef>{a.ref()});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("no/such/dir/x.safetensors.tmp"), std::string::npos) << s.message();
}

TEST_F(SafetensorsTest, TruncatedFileIsDataLoss) {
  std::vector<HostTensor> ts;
  ts.push_back(Filled("first", DType::kBF16, {64}, 1));
  ts.push_back(Filled("last", DType::kBF16, {64}, 2));
  const std::string path = Path("trunc.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, Refs(ts)).ok());
  fs::resize_file(path, fs::file_size(path) - 3);
  ExpectOpenError(path, StatusCode::kDataLoss, {path, "tensor last", "truncated"});

  fs::resize_file(path, 20);  // cuts into the header
  ExpectOpenError(path, StatusCode::kDataLoss, {path, "header length"});
  fs::resize_file(path, 5);
  ExpectOpenError(path, StatusCode::kDataLoss, {path, "5 bytes"});
}

TEST_F(SafetensorsTest, CorruptHeadersNameFileAndTensor) {
  const std::string p = Path("bad.safetensors");
  WriteRaw(p, R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,100]}})", 16);
  ExpectOpenError(p, StatusCode::kDataLoss, {p, "tensor w", "[0, 100]"});

  WriteRaw(p, R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "tensor w", "F32 [3] needs 12"});

  WriteRaw(p, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)", 8);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "not valid JSON"});

  WriteRaw(p, R"([1,2,3])", 0);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "not a JSON object"});

  WriteRaw(p, R"({"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "tensor w", "Q4"});

  WriteRaw(p, R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "tensor w", "negative"});

  WriteRaw(p, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "tensor w", "data_offsets"});

  WriteRaw(p, R"({"w":{"dtype":"F32","shape":[2]}})", 8);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "tensor w", "data_offsets"});

  WriteRaw(p,
           R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
           R"("y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           12);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "tensor y [4, 12] overlaps tensor x [0, 8]"});

  WriteRaw(p, R"({"__metadata__":{"step":7}})", 0);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "__metadata__", "step"});

  // A header length far beyond any sane size.
  std::vector<std::byte> huge(16, std::byte{0});
  huge[5] = std::byte{1};  // 2^40
  WriteBytes(p, huge);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "limit"});

  ExpectOpenError(Path("absent.safetensors"), StatusCode::kNotFound, {"absent.safetensors"});
}

// A header nested 100,000 deep is refused before parsing, with or without quoting the
// file; a deep value inside a field is described flat, never dumped.
TEST_F(SafetensorsTest, DeepHeadersAreRefused) {
  const std::string p = Path("deep.safetensors");
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  WriteRaw(p, R"({"w":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,8]}})", 8);
  auto f = SafetensorsFile::Open(p);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(f.status().message(), p + ": header: field 'w' nests deeper than 64 levels");

  const std::string header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[[[[8]]],0]}})";
  WriteRaw(p, header, 8);
  f = SafetensorsFile::Open(p);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().message(),
            p + ": tensor w: data_offsets [a list of 1 items, 0] are not ordered non-negative integers");
  auto h = ParseSafetensorsHeader(header, 8 + header.size() + 8, "sync/x.safetensors",
                                  SafetensorsHeaderOptions{.quote_file = false});
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().message(), "sync/x.safetensors: tensor w: data_offsets are not ordered non-negative integers");
}

// Shapes whose element count overflows int64, even partially (a zero dimension after
// huge ones), are refused: numel() and nbytes() of every tensor read are then defined.
TEST_F(SafetensorsTest, ShapesThatOverflowInt64AreRefused) {
  const std::string p = Path("huge.safetensors");
  WriteRaw(p, R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "tensor w", "overflows int64"});
  WriteRaw(p, R"({"w":{"dtype":"BF16","shape":[4611686018427387904,2,0],"data_offsets":[0,0]}})", 0);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "tensor w", "[4611686018427387904, 2, 0]", "overflows int64"});
  WriteRaw(p, R"({"w":{"dtype":"F32","shape":[2147483648,4294967296,0],"data_offsets":[0,0]}})", 0);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "tensor w", "overflows int64"});
  WriteRaw(p, R"({"w":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,0]}})", 0);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "tensor w"});
  // numel fits int64 but its bytes do not: refused by the byte count.
  WriteRaw(p, R"({"w":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", 8);
  ExpectOpenError(p, StatusCode::kInvalidArgument, {p, "tensor w"});
  // A zero dimension with small ones is an ordinary empty tensor.
  WriteRaw(p, R"({"w":{"dtype":"F32","shape":[3,0,5],"data_offsets":[0,0]}})", 0);
  auto f = SafetensorsFile::Open(p);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->tensors()[0].nbytes(), 0u);
}

TEST_F(SafetensorsTest, WriterRefusesShapesThatOverflowInt64) {
  const Shape shape = {int64_t{1} << 62, 4};  // 2^64 elements
  TensorRef t{"w", DType::kBF16, shape, {}, Device{}};
  Status s = WriteSafetensors(Path("w.safetensors"), std::span<const TensorRef>(&t, 1));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("more bytes than int64 counts"), std::string::npos) << s.ToString();
}

TEST_F(SafetensorsTest, EmptyAndGappyFilesAreAccepted) {
  const std::string p = Path("empty.safetensors");
  ASSERT_TRUE(WriteSafetensors(p, {}).ok());
  auto f = SafetensorsFile::Open(p);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_TRUE(f->tensors().empty());
  EXPECT_EQ(fs::file_size(p), 16u);  // "{}" padded to 8

  // Zero-size tensors may share an offset; unused bytes between tensors are tolerated.
  WriteRaw(p,
           R"({"z1":{"dtype":"BF16","shape":[0],"data_offsets":[8,8]},)"
           R"("z2":{"dtype":"F32","shape":[0,3],"data_offsets":[8,8]},)"
           R"("w":{"dtype":"U8","shape":[4],"data_offsets":[12,16]}})",
           16);
  f = SafetensorsFile::Open(p);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->tensors().size(), 3u);
  EXPECT_EQ(f->tensors()[2].name, "w");
  EXPECT_EQ(f->Bytes("w")->size(), 4u);
  EXPECT_EQ(f->Bytes("z1")->size(), 0u);
}

TEST_F(SafetensorsTest, CheckpointDirWithoutIndex) {
  std::vector<HostTensor> s1, s2;
  s1.push_back(Filled("model.layers.0.w", DType::kBF16, {4, 4}, 1));
  s1.push_back(Filled("model.embed.weight", DType::kBF16, {8, 4}, 2));
  s2.push_back(Filled("lm_head.weight", DType::kBF16, {8, 4}, 3));
  s2.push_back(Filled("model.norm.weight", DType::kF32, {4}, 4));
  // Written in reverse name order to show that file name, not creation, decides.
  ASSERT_TRUE(WriteSafetensors(Path("model-00002-of-00002.safetensors"), Refs(s2)).ok());
  ASSERT_TRUE(WriteSafetensors(Path("model-00001-of-00002.safetensors"), Refs(s1)).ok());
  std::ofstream(Path("config.json")) << "{}";

  auto c = CheckpointDir::Open(dir_);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ(c->files().size(), 2u);
  std::vector<std::string> names;
  for (const auto& m : c->tensors()) names.push_back(m.name);
  // File order, then offset order (F32 leads file 2 because of the writer's layout).
  EXPECT_EQ(names, (std::vector<std::string>{"model.layers.0.w", "model.embed.weight",
                                             "model.norm.weight", "lm_head.weight"}));
  for (const auto* group : {&s1, &s2}) {
    for (const HostTensor& t : *group) {
      EXPECT_TRUE(SameBytes(*c->Bytes(t.meta.name), t.storage.span())) << t.meta.name;
    }
  }
  EXPECT_EQ((*c->FileOf("lm_head.weight"))->path(), Path("model-00002-of-00002.safetensors"));
  EXPECT_EQ(c->Bytes("missing").status().code(), StatusCode::kNotFound);

  // A second file holding a name already present is an error naming both files.
  ASSERT_TRUE(WriteSafetensors(Path("extra.safetensors"), Refs(s2)).ok());
  auto dup = CheckpointDir::Open(dir_);
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("extra.safetensors"), std::string::npos) << dup.status().message();
  EXPECT_NE(dup.status().message().find("model-00002-of-00002.safetensors"), std::string::npos);
  // extra.safetensors sorts first, so the clash shows at model-00002's first tensor.
  EXPECT_NE(dup.status().message().find("tensor model.norm.weight is in both"), std::string::npos);
}

TEST_F(SafetensorsTest, CheckpointDirWithIndex) {
  std::vector<HostTensor> s1, s2;
  s1.push_back(Filled("a", DType::kBF16, {4}, 1));
  s2.push_back(Filled("b", DType::kF16, {2, 2}, 2));
  s2.push_back(Filled("c", DType::kF8E4M3, {16}, 3));
  ASSERT_TRUE(WriteSafetensors(Path("part-1.safetensors"), Refs(s1)).ok());
  ASSERT_TRUE(WriteSafetensors(Path("part-2.safetensors"), Refs(s2)).ok());
  // A stray file the index does not name is ignored, even though it duplicates "a".
  ASSERT_TRUE(WriteSafetensors(Path("consolidated.safetensors"), Refs(s1)).ok());
  auto write_index = [&](const nlohmann::json& wm) {
    std::ofstream(Path("model.safetensors.index.json"))
        << nlohmann::json{{"metadata", {{"total_size", 44}}}, {"weight_map", wm}}.dump();
  };
  write_index({{"a", "part-1.safetensors"}, {"b", "part-2.safetensors"}, {"c", "part-2.safetensors"}});

  auto c = CheckpointDir::Open(dir_);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->files().size(), 2u);
  ASSERT_EQ(c->tensors().size(), 3u);
  EXPECT_EQ(c->tensors()[0].name, "a");
  EXPECT_TRUE(SameBytes(*c->Bytes("c"), s2[1].storage.span()));

  write_index({{"a", "part-1.safetensors"}, {"b", "part-1.safetensors"}, {"c", "part-2.safetensors"}});
  auto wrong = CheckpointDir::Open(dir_);
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(wrong.status().message().find("maps b to"), std::string::npos) << wrong.status().message();

  write_index({{"a", "part-1.safetensors"}, {"zz", "part-2.safetensors"}});
  auto absent = CheckpointDir::Open(dir_);
  ASSERT_FALSE(absent.ok());
  EXPECT_NE(absent.status().message().find("zz"), std::string::npos) << absent.status().message();

  write_index({{"a", "part-9.safetensors"}});
  auto no_file = CheckpointDir::Open(dir_);
  ASSERT_FALSE(no_file.ok());
  EXPECT_EQ(no_file.status().code(), StatusCode::kNotFound);
  EXPECT_NE(no_file.status().message().find("part-9.safetensors"), std::string::npos);

  write_index({{"a", "../part-1.safetensors"}});
  EXPECT_EQ(CheckpointDir::Open(dir_).status().code(), StatusCode::kInvalidArgument);

  std::ofstream(Path("model.safetensors.index.json")) << "{not json";
  EXPECT_EQ(CheckpointDir::Open(dir_).status().code(), StatusCode::kInvalidArgument);

  std::ofstream(Path("model.safetensors.index.json"))
      << R"({"metadata": )" << std::string(100000, '[') << std::string(100000, ']') << "}";
  auto deep = CheckpointDir::Open(dir_);
  ASSERT_FALSE(deep.ok());
  EXPECT_EQ(deep.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(deep.status().message().find("model.safetensors.index.json: field 'metadata' nests deeper than 64 levels"),
            std::string::npos)
      << deep.status().message();
}

TEST_F(SafetensorsTest, EmptyOrMissingDirIsNotFound) {
  EXPECT_EQ(CheckpointDir::Open(dir_).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(CheckpointDir::Open(Path("nope")).status().code(), StatusCode::kNotFound);
}

TEST_F(SafetensorsTest, CheckpointSourceYieldsZeroCopyRefs) {
  std::vector<HostTensor> ts;
  ts.push_back(Filled("x", DType::kBF16, {3, 2}, 1));
  ts.push_back(Filled("y", DType::kBF16, {5}, 2));
  ts.push_back(Filled("z", DType::kBF16, {1}, 3));
  ASSERT_TRUE(WriteSafetensors(Path("model.safetensors"), Refs(ts)).ok());

  auto src = OpenCheckpointSource(dir_);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  ASSERT_EQ((*src)->metadata().size(), 3u);
  auto stream = CheckedStream(*(*src)->Iterate(), (*src)->metadata());
  TensorRef r;
  size_t n = 0;
  while (*stream->Next(&r)) {
    EXPECT_EQ(r.name, ts[n].meta.name);
    EXPECT_TRUE(SameBytes(r.bytes, ts[n].storage.span()));
    ++n;
  }
  EXPECT_EQ(n, 3u);

  auto ordered = OpenCheckpointSource(dir_, std::vector<std::string>{"z", "x", "y"});
  ASSERT_TRUE(ordered.ok()) << ordered.status().ToString();
  EXPECT_EQ((*ordered)->metadata()[0], ts[2].meta);
  auto s2 = CheckedStream(*(*ordered)->Iterate(), (*ordered)->metadata());
  ASSERT_TRUE(*s2->Next(&r));
  EXPECT_EQ(r.name, "z");
  ASSERT_TRUE(*s2->Next(&r));
  EXPECT_EQ(r.name, "x");
  EXPECT_EQ(r.shape.size(), 2u);
  // Two passes over one source give the same view of the mapping.
  auto again = *(*ordered)->Iterate();
  TensorRef r2;
  ASSERT_TRUE(*again->Next(&r2));
  ASSERT_TRUE(*again->Next(&r2));
  EXPECT_EQ(r2.bytes.data(), r.bytes.data());

  auto unknown = OpenCheckpointSource(dir_, std::vector<std::string>{"z", "x", "q"});
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  auto twice = OpenCheckpointSource(dir_, std::vector<std::string>{"z", "x", "x"});
  EXPECT_EQ(twice.status().code(), StatusCode::kInvalidArgument);
  auto partial = OpenCheckpointSource(dir_, std::vector<std::string>{"z", "x"});
  ASSERT_FALSE(partial.ok());
  EXPECT_NE(partial.status().message().find("leaves out tensor y"), std::string::npos)
      << partial.status().message();
}

}  // namespace
}  // namespace wsync
