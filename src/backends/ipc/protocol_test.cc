#include "backends/ipc/protocol.h"

#include <tuple>

#include <gtest/gtest.h>

#include "core/json_limits.h"

namespace wsync {
namespace {

using nlohmann::json;

TensorMeta T(std::string name, int64_t elems, DType d = DType::kBF16) { return {std::move(name), d, {elems}}; }

IpcInitInfo ValidInit() {
  IpcInitInfo i;
  i.session = std::string(32, 'a');
  i.control_path = "/proc/1/fd/3";
  i.control_bytes = 8 << 20;
  i.slot_bytes = 1 << 20;
  i.reader_offset = 1;
  i.reader_count = 4;
  i.buffers["host-x"] = IpcBufferDesc{"shm", 2 << 20, 2 << 20, json::object()};
  i.timeout_seconds = 30;
  return i;
}

TEST(IpcProtocol, BufferEntriesNameTheirPublisherOnlyWhenNotRankZero) {
  IpcInitInfo i = ValidInit();
  i.buffers["GPU-b"] = IpcBufferDesc{"cuda_ipc", 0, 2 << 20, json{{"handle_b64", "x"}}, 1};
  json j = i.ToJson();
  EXPECT_FALSE(j["buffers"]["host-x"].contains("publisher"));  // rank 0's: as in version 2
  EXPECT_EQ(j["buffers"]["GPU-b"]["publisher"], 1);
  auto back = IpcInitInfo::Parse(j);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->buffers.at("GPU-b").publisher, 1);
  EXPECT_EQ(back->buffers.at("host-x").publisher, 0);
  j["buffers"]["GPU-b"]["publisher"] = -1;
  auto bad = IpcInitInfo::Parse(j);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("buffers['GPU-b'] publisher -1"), std::string::npos) << bad.status().message();
}

TEST(IpcProtocol, InitInfoRoundTrips) {
  IpcInitInfo i = ValidInit();
  auto back = IpcInitInfo::Parse(i.ToJson());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->ToJson(), i.ToJson());
  EXPECT_EQ(back->buffers.at("host-x").offset, uint64_t{2} << 20);
}

TEST(IpcProtocol, DeviceDigestsRoundTripAsAFlagSentOnlyWhenSet) {
  IpcInitInfo i = ValidInit();
  EXPECT_FALSE(i.ToJson().contains("wsync_device_digests"));
  i.wsync_device_digests = true;
  auto back = IpcInitInfo::Parse(i.ToJson());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->wsync_device_digests);
  json j = i.ToJson();
  j["wsync_device_digests"] = "yes";
  auto bad = IpcInitInfo::Parse(j);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("wsync_device_digests"), std::string::npos) << bad.status().message();
}

TEST(IpcProtocol, InitInfoErrorsNameTheField) {
  auto expect = [](json j, const std::string& needle, StatusCode code = StatusCode::kInvalidArgument) {
    auto r = IpcInitInfo::Parse(j);
    ASSERT_FALSE(r.ok()) << j.dump();
    EXPECT_EQ(r.status().code(), code) << r.status().ToString();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  json good = ValidInit().ToJson();
  expect(json{{"packed", false}}, "wsync_ipc_protocol");  // vLLM's own ipc init_info
  json j = good;
  j["wsync_ipc_protocol"] = 1;  // the body carried the sync's numbers then
  expect(j, "wsync_ipc_protocol 1 is not supported (this server speaks 3)");
  j = good;
  j["bogus"] = 1;
  expect(j, "unknown field 'bogus'");
  j = good;
  j["session"] = "xyz";
  expect(j, "session");
  j = good;
  j.erase("control_path");
  expect(j, "missing 'control_path'");
  j = good;
  j["control_path"] = "relative/path";
  expect(j, "absolute");
  j = good;
  j["reader_offset"] = 4;
  expect(j, "reader_offset 4");
  j = good;
  j["num_slots"] = 9;
  expect(j, "num_slots");
  j = good;
  j["buffers"] = json::object();
  expect(j, "buffers");
  j = good;
  j["buffers"]["host-x"]["stride"] = 5;
  expect(j, "stride 5");
  j = good;
  j["buffers"]["host-x"]["kind"] = "rdma";
  expect(j, "rdma");
  j = good;
  j["packed"] = false;
  expect(j, "packed=false", StatusCode::kUnimplemented);
  j = good;
  j["slot_bytes"] = -1;
  expect(j, "slot_bytes");
}

TEST(IpcProtocol, IntegersAreReadAtTheirExactWidthAndRangeNeverNarrowed) {
  auto refused = [](const json& j, const std::string& needle) {
    auto r = IpcInitInfo::Parse(j);
    ASSERT_FALSE(r.ok()) << j.dump();
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  json good = ValidInit().ToJson();
  json j = good;
  j["num_slots"] = uint64_t{4294967297};  // an int read of it is 1
  refused(j, "'num_slots' = 4294967297 is outside");
  j = good;
  j["reader_count"] = uint64_t{4294967300};  // 4 as an int
  refused(j, "'reader_count' = 4294967300 is outside");
  j = good;
  j["reader_count"] = kIpcMaxReaders + 1;
  refused(j, "reader_count 65537 must be within 1..65536");
  j = good;
  j["reader_offset"] = -1;
  refused(j, "reader_offset -1");
  j = good;
  j["wsync_ipc_protocol"] = uint64_t{4294967299};  // 3 as an int
  refused(j, "'wsync_ipc_protocol' = 4294967299 is outside");
  j = good;
  j["control_bytes"] = -4096;
  refused(j, "'control_bytes' = -4096 is outside 0..18446744073709551615");
  j = good;
  j["slot_bytes"] = 1.5;
  refused(j, "'slot_bytes' must be an integer");
  j = good;
  j["slot_bytes"] = 1e30;  // beyond uint64: parsed as a float
  refused(j, "'slot_bytes' must be an integer");
  j = good;
  j["buffers"]["host-x"]["publisher"] = uint64_t{4294967296};  // 0 as an int
  refused(j, "'publisher' = 4294967296 is outside");
  j = good;
  j["buffers"]["host-x"]["publisher"] = kIpcMaxPublishers;
  refused(j, "publisher 1024 must be within 0..1023");
  j = good;
  j["buffers"]["host-x"]["offset"] = -1;
  refused(j, "'offset' = -1 is outside");
  j = good;
  j["timeout_seconds"] = 1e300;
  refused(j, "timeout_seconds");
  j = good;
  j["control_path"] = "/proc/1/fd/3\n\x01";
  refused(j, "printable ASCII");
  j = good;
  j["control_path"] = "/" + std::string(254, 'a') + "\xc3\xa9";  // a cut at 256 bytes would split the e-acute
  auto r = IpcInitInfo::Parse(j);
  ASSERT_FALSE(r.ok());
  EXPECT_NO_THROW((void)json(r.status().message()).dump()) << "a message must stay valid UTF-8";

  // The update's lists and zero-copy numbers are unsigned 64-bit, never negative.
  json u = {{"wsync_ipc_protocol", kIpcProtocolVersion}, {"session", std::string(32, 'a')},
            {"tensor_sizes", {1}}, {"tensor_offsets", {0}}, {"chunk_ends", {1}}};
  ASSERT_TRUE(IpcUpdateInfo::Parse(u).ok());
  json bad = u;
  bad["tensor_sizes"] = {-1};
  EXPECT_FALSE(IpcUpdateInfo::Parse(bad).ok());
  bad = u;
  bad["tensor_offsets"] = {1e19};
  EXPECT_FALSE(IpcUpdateInfo::Parse(bad).ok());
  bad = u;
  bad["wsync_ipc_protocol"] = uint64_t{4294967299};
  EXPECT_FALSE(IpcUpdateInfo::Parse(bad).ok());
  bad = u;
  bad["zero_copy"] = {{"generation", -1}, {"bytes", 1}};
  EXPECT_FALSE(IpcUpdateInfo::Parse(bad).ok());
  bad = u;
  bad["zero_copy"] = {{"generation", 1}, {"bytes", -1}};
  EXPECT_FALSE(IpcUpdateInfo::Parse(bad).ok());

  // Text fields are bounded and refused values are shown flat: no message grows with, or
  // recurses over, what the request sent.
  bad = u;
  bad["session"] = std::string(100000, 's');
  EXPECT_EQ(IpcUpdateInfo::Parse(bad).status().message(),
            "update_info session '" + std::string(64, 's') + "... (100000 bytes)' is not 32 lowercase hex digits");
  json deep = json::array();
  for (int i = 0; i < 60; ++i) deep = json::array({deep});
  bad = u;
  bad["tensor_sizes"] = {1, deep};
  EXPECT_EQ(IpcUpdateInfo::Parse(bad).status().message(),
            "update_info tensor_sizes[1] must be a non-negative integer, got a list of 1 items");
  bad = u;
  bad["wsync_ipc_protocol"] = deep;
  EXPECT_EQ(IpcUpdateInfo::Parse(bad).status().message(),
            "update_info 'wsync_ipc_protocol' must be an integer, got a list of 1 items");
  j = good;
  j["buffers"][std::string(kMaxNameBytes + 1, 'k')] = j["buffers"].begin().value();
  EXPECT_EQ(IpcInitInfo::Parse(j).status().message(),
            "init_info buffers has a device key of 1025 bytes, over the limit of 1024");
  j = good;
  j[std::string(100000, 'f')] = 1;
  EXPECT_EQ(IpcInitInfo::Parse(j).status().message(),
            "init_info has unknown field '" + std::string(64, 'f') + "... (100000 bytes)'");
}

TEST(IpcProtocol, CutIsBeforeTheOverflowingTensorAndOffsetsAreAligned) {
  // 100 bytes each (bf16 x 50): with 256-byte alignment two fit in 356 <= 400, a third
  // would end at 612.
  std::vector<TensorMeta> ts = {T("a", 50), T("b", 50), T("c", 50), T("d", 200)};
  auto plan = PlanIpcChunks(ts, 400);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->chunk_ends, (std::vector<uint64_t>{2, 3, 4}));
  EXPECT_EQ(plan->tensor_offsets, (std::vector<uint64_t>{0, 256, 0, 0}));
  EXPECT_EQ(plan->chunk_bytes, (std::vector<uint64_t>{356, 100, 400}));
  EXPECT_EQ(plan->payload_bytes, 700u);
  for (uint64_t b : plan->chunk_bytes) EXPECT_LE(b, 400u);  // a chunk never exceeds the slot

  auto too_big = PlanIpcChunks(ts, 399);
  ASSERT_FALSE(too_big.ok());
  EXPECT_NE(too_big.status().message().find("tensor d"), std::string::npos) << too_big.status().message();
  EXPECT_TRUE(PlanIpcChunks({}, 10)->chunk_ends.empty());
}

TEST(IpcProtocol, SlotIsBucketOrLargestTensorButNoMoreThanTheModel) {
  std::vector<TensorMeta> ts = {T("a", 50), T("b", 500)};  // 100 + 1000 bytes
  EXPECT_EQ(IpcSlotBytes(ts, 10), 1000u);         // largest tensor
  EXPECT_EQ(IpcSlotBytes(ts, 1 << 30), 256u + 1000u);  // the whole model in one chunk
  EXPECT_EQ(IpcSlotBytes(ts, 1200), 1200u);
}

IpcUpdateInfo UpdateFor(const std::vector<TensorMeta>& ts, uint64_t slot) {
  IpcPlan plan = *PlanIpcChunks(ts, slot);
  IpcUpdateInfo u;
  u.session = std::string(32, 'b');
  u.sync = 3;
  u.first_seq = 7;
  for (const auto& t : ts) u.tensor_sizes.push_back(t.nbytes());
  u.tensor_offsets = plan.tensor_offsets;
  u.chunk_ends = plan.chunk_ends;
  return u;
}

TEST(IpcProtocol, UpdateInfoRoundTripsAndValidates) {
  std::vector<TensorMeta> ts = {T("a", 50), T("b", 50), T("c", 200)};
  IpcUpdateInfo u = UpdateFor(ts, 400);
  json j = {{"names", json::array()}};
  u.AddTo(&j);
  auto back = IpcUpdateInfo::Parse(j);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->chunk_ends, u.chunk_ends);
  EXPECT_EQ(back->first_seq, 0u);  // the sync's numbers travel in the control region
  EXPECT_FALSE(j.contains("sync"));
  EXPECT_FALSE(j.contains("first_seq"));
  EXPECT_TRUE(back->Validate(ts, 400).ok());

  // A chunk larger than the mapped slots.
  Status s = back->Validate(ts, 300);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("the mapped slots hold 300"), std::string::npos) << s.message();

  IpcUpdateInfo bad = u;
  bad.tensor_sizes[1] = 99;
  s = bad.Validate(ts, 400);
  EXPECT_NE(s.message().find("tensor_sizes[1] of b"), std::string::npos) << s.message();
  bad = u;
  bad.tensor_offsets[1] = 10;  // overlaps a
  s = bad.Validate(ts, 400);
  EXPECT_NE(s.message().find("overlapping"), std::string::npos) << s.message();
  bad = u;
  bad.chunk_ends = {2};
  s = bad.Validate(ts, 400);
  EXPECT_NE(s.message().find("chunk_ends must end"), std::string::npos) << s.message();
  bad = u;
  bad.chunk_ends = {0, 3};
  EXPECT_FALSE(bad.Validate(ts, 400).ok());
  bad = u;
  bad.chunk_ends = {2, 5, 3};
  EXPECT_FALSE(bad.Validate(ts, 400).ok());
  IpcUpdateInfo empty;  // no tensors, but chunks that would index them
  empty.chunk_ends = {5};
  EXPECT_FALSE(empty.Validate({}, 400).ok());
  empty.chunk_ends.clear();
  EXPECT_TRUE(empty.Validate({}, 400).ok());
  bad = u;
  bad.tensor_offsets.pop_back();
  EXPECT_FALSE(bad.Validate(ts, 400).ok());
  bad = u;
  bad.tensor_offsets[2] = ~uint64_t{0} - 10;  // no overflow in the bounds check
  s = bad.Validate(ts, 400);
  EXPECT_NE(s.message().find("the mapped slots hold"), std::string::npos) << s.message();
}

TEST(IpcProtocol, ZeroCopyUpdatesRoundTripAndAreOneChunkBoundedByTheExport) {
  std::vector<TensorMeta> ts = {T("a", 50), T("b", 50), T("c", 200)};  // bf16: 100, 100, 400 bytes
  IpcUpdateInfo u;
  u.session = std::string(32, 'b');
  u.sync = 3;
  u.first_seq = 9;
  u.tensor_sizes = {100, 100, 400};
  u.tensor_offsets = {0, 256, 512};
  u.chunk_ends = {3};
  u.zero_copy = IpcZeroCopy{2, 912, {}};
  u.zero_copy->buffers["GPU-x"] = IpcBufferDesc{"cuda_ipc", 4096, 0, json{{"handle_b64", "AAAA"}}};
  json j = {{"names", json::array()}};
  u.AddTo(&j);
  auto back = IpcUpdateInfo::Parse(j);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_TRUE(back->zero_copy.has_value());
  EXPECT_EQ(back->zero_copy->generation, 2u);
  EXPECT_EQ(back->zero_copy->bytes, 912u);
  EXPECT_EQ(back->zero_copy->buffers.at("GPU-x").offset, 4096u);
  // Bounded by the export, not by the (smaller) slots.
  EXPECT_TRUE(back->Validate(ts, 300).ok());
  IpcUpdateInfo bad = *back;
  bad.zero_copy->bytes = 911;
  Status s = bad.Validate(ts, 1 << 20);
  EXPECT_NE(s.message().find("beyond the 911 bytes of the trainer's exported tensors"), std::string::npos)
      << s.message();
  bad = *back;
  bad.chunk_ends = {1, 3};
  s = bad.Validate(ts, 1 << 20);
  EXPECT_NE(s.message().find("one chunk"), std::string::npos) << s.message();

  // Later updates of a generation carry no handle; wrong shapes are 400s naming the field.
  u.zero_copy->buffers.clear();
  j = {{"names", json::array()}};
  u.AddTo(&j);
  EXPECT_FALSE(j["zero_copy"].contains("buffers"));
  ASSERT_TRUE(IpcUpdateInfo::Parse(j).ok());
  for (auto [field, value, needle] : {std::tuple{"generation", json(0), "generation must be >= 1"},
                                      std::tuple{"bytes", json("x"), "'bytes' must be an integer"},
                                      std::tuple{"extra", json(1), "unknown field 'extra'"},
                                      std::tuple{"buffers", json{{"GPU-x", {{"kind", "shm"}, {"offset", 0},
                                                                           {"stride", 0}}}},
                                                 "is not cuda_ipc or cuda_fd"}}) {
    json k = j;
    k["zero_copy"][field] = value;
    auto r = IpcUpdateInfo::Parse(k);
    ASSERT_FALSE(r.ok()) << field;
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  }
}

TEST(IpcProtocol, ZeroCopyOnlyTrainersListTheirGpuAsKindNone) {
  IpcInitInfo i = ValidInit();
  i.buffers.clear();
  i.buffers["GPU-x"] = IpcBufferDesc{"none", 0, 0, json::object()};
  auto back = IpcInitInfo::Parse(i.ToJson());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->buffers.at("GPU-x").kind, "none");
  i.buffers["GPU-x"].kind = "cuda_ipc";  // slots, but a stride below slot_bytes
  EXPECT_FALSE(IpcInitInfo::Parse(i.ToJson()).ok());
}

TEST(IpcProtocol, UpdateInfoRejectsTorchPickledHandlesAndMissingFields) {
  auto r = IpcUpdateInfo::Parse(json{{"ipc_handles_pickled", "gASV"}});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("torch-pickled"), std::string::npos);
  r = IpcUpdateInfo::Parse(json{{"names", json::array()}});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("wsync_ipc_protocol"), std::string::npos);
  json j;
  UpdateFor({T("a", 4)}, 64).AddTo(&j);
  j["tensor_offsets"] = json::array({-1});
  r = IpcUpdateInfo::Parse(j);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tensor_offsets[0]"), std::string::npos) << r.status().message();
}

TEST(IpcProtocol, ReaderOffsetsFollowDeploymentsOfAnySize) {
  std::vector<int> offsets;
  EXPECT_EQ(*IpcReaderOffsets({1, 2}, 1, &offsets), 3);  // a TP=1 and a TP=2 server
  EXPECT_EQ(offsets, (std::vector<int>{0, 1}));
  EXPECT_EQ(*IpcReaderOffsets({4, 4, 2, 2}, 2, &offsets), 6);  // two external-LB deployments
  EXPECT_EQ(offsets, (std::vector<int>{0, 0, 4, 4}));
  EXPECT_FALSE(IpcReaderOffsets({4, 4, 4}, 2, &offsets).ok());
  auto r = IpcReaderOffsets({4, 2}, 2, &offsets);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("report world sizes 4 and 2"), std::string::npos) << r.status().message();
}

TEST(IpcProtocol, AMissingDeviceKeyIsA400NamingTheKeysOffered) {
  IpcInitInfo i = ValidInit();
  i.buffers.clear();
  i.buffers["GPU-11111111-2222-3333-4444-555555555555"] = IpcBufferDesc{"cuda_fd", 0, 1 << 20, json::object()};
  i.buffers["GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"] = IpcBufferDesc{"cuda_ipc", 0, 1 << 20, json::object()};
  auto b = i.FindBuffer("GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->kind, "cuda_ipc");
  auto missing = i.FindBuffer("GPU-99999999-0000-0000-0000-000000000000");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("GPU-99999999-0000-0000-0000-000000000000"), std::string::npos);
  EXPECT_NE(missing.status().message().find("GPU-11111111-2222-3333-4444-555555555555"), std::string::npos)
      << missing.status().message();
}

TEST(IpcProtocol, HostKeyIsStableAndSessionsAreFresh) {
  EXPECT_EQ(HostDeviceKey(), HostDeviceKey());
  EXPECT_EQ(HostDeviceKey().rfind("host-", 0), 0u);
  std::string a = NewSessionId(), b = NewSessionId();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace wsync
