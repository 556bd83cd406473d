// Shared ground of the src/sources tests: every trainer rank is a thread of the test
// process with its own trainer group (Gloo communicator and stop board, through a store
// the helper hosts), models are SyntheticTrainer weights of registered configs, and a
// pass is compared with the original HF tensors byte for byte.
#pragma once

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "comm/store.h"
#include "sources/layout.h"
#include "sources/sources.h"
#include "sources/trainer_ranks.h"
#include "synthetic/synthetic.h"

namespace wsync::sources_test {

using RankFn = std::function<void(int rank, std::shared_ptr<Communicator> comm)>;
using GroupFn = std::function<void(int rank, std::shared_ptr<TrainerGroup> group)>;

// Runs `fn` on `n` threads, each joined to one trainer group of n ranks.
inline void RunGroups(const ParallelLayout& layout, double timeout_s, const GroupFn& fn) {
  static std::atomic<int> group{0};  // one prefix per group in this process
  auto store = StoreServer::Start("127.0.0.1", 0);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TrainerGroupOptions o;
  o.store_port = (*store)->port();
  o.prefix = "sources-test/" + std::to_string(group++);
  o.timeout_seconds = timeout_s;
  std::vector<std::thread> threads;
  for (int r = 0; r < layout.world; ++r) {
    threads.emplace_back([&, r] {
      auto g = TrainerGroup::Connect(o, layout, r);
      ASSERT_TRUE(g.ok()) << g.status().ToString();
      fn(r, *g);
    });
  }
  for (auto& t : threads) t.join();
}

// The same with only each rank's communicator.
inline void RunRanks(const ParallelLayout& layout, double timeout_s, const RankFn& fn) {
  RunGroups(layout, timeout_s, [&](int rank, std::shared_ptr<TrainerGroup> g) { fn(rank, g->comm()); });
}

inline std::unique_ptr<SyntheticTrainer> Model(const ModelConfig& c) {
  auto t = SyntheticTrainer::FromMetadata(HfTensors(c), 7, 2);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(*t);
}

// Drains one pass and checks it equals `full` byte for byte. With `held`, the pass is the
// held pass (IterateHeld) and must yield exactly the tensors of `full` that HeldNames()
// lists (all of them for nullopt), in order.
inline void ExpectPassEquals(WeightSource& source, const std::vector<HostTensor>& full, const std::string& who,
                             bool held = false) {
  const auto names = held ? source.HeldNames() : std::nullopt;
  std::set<std::string> wanted;
  if (names) wanted.insert(names->begin(), names->end());
  std::vector<const HostTensor*> want;
  std::vector<TensorMeta> meta;
  for (const HostTensor& t : full) {
    if (names && !wanted.contains(t.meta.name)) continue;
    want.push_back(&t);
    meta.push_back(t.meta);
  }
  if (names) {
    ASSERT_EQ(want.size(), names->size()) << who << ": a held name is not in the model";
  }
  auto stream = held ? source.IterateHeld() : source.Iterate();
  ASSERT_TRUE(stream.ok()) << who << ": " << stream.status().ToString();
  auto checked = CheckedStream(std::move(*stream), meta);
  TensorRef t;
  size_t i = 0;
  for (;; ++i) {
    auto more = checked->Next(&t);
    ASSERT_TRUE(more.ok()) << who << ": " << more.status().ToString();
    if (!*more) break;
    ASSERT_LT(i, want.size()) << who;
    ASSERT_EQ(t.name, want[i]->meta.name) << who;
    ASSERT_EQ(t.bytes.size(), want[i]->meta.nbytes()) << who << ": " << t.name;
    ASSERT_EQ(0, std::memcmp(t.bytes.data(), want[i]->storage.data(), t.bytes.size()))
        << who << ": bytes of " << t.name << " differ from the original";
  }
  EXPECT_EQ(i, want.size()) << who;
}

inline ModelConfig Config(const std::string& name) {
  auto c = LookupModel(name);
  EXPECT_TRUE(c.ok());
  return *c;
}

// qwen3-tiny with 4 KV heads, so that tp = 4 divides the query groups.
inline ModelConfig TinyKv4() {
  ModelConfig c = Config("qwen3-tiny");
  c.name = "qwen3-tiny-kv4";
  c.num_key_value_heads = 4;
  return c;
}

// qwen3-moe-tiny with 4 KV heads, for tp = 4.
inline ModelConfig MoeKv4() {
  ModelConfig c = Config("qwen3-moe-tiny");
  c.name = "qwen3-moe-tiny-kv4";
  c.num_key_value_heads = 4;
  return c;
}

inline const WorkerParam* FindParam(const MegatronLayout& l, int rank, const std::string& name) {
  for (const WorkerParam& p : l.params(rank)) {
    if (p.meta.name == name) return &p;
  }
  return nullptr;
}

inline void RoundTrip(const ModelConfig& c, const ParallelLayout& layout, int passes = 1) {
  auto model = Model(c);
  const auto& full = model->tensors();
  RunRanks(layout, 60, [&](int rank, std::shared_ptr<Communicator> comm) {
    std::string who = c.name + " " + layout.ToString() + " " + layout.Describe(rank);
    auto source = BuildRankSource(comm, layout, &c, full, 60);
    ASSERT_TRUE(source.ok()) << who << ": " << source.status().ToString();
    for (int p = 0; p < passes; ++p) ExpectPassEquals(**source, full, who);
  });
}

// Layout `text` with no data-parallel replicas: world = tp * pp * ep.
inline ParallelLayout OneReplica(const std::string& text) {
  ParallelLayout cell = *ParallelLayout::Parse(text, 64);  // 64: a multiple of every cell here
  return *ParallelLayout::Parse(text, cell.tp * cell.pp * cell.ep);
}

inline double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace wsync::sources_test
