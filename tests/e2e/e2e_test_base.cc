#include "e2e_test_base.h"

#include <httplib.h>
#include <signal.h>
#include <stdlib.h>

#include <string.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "core/parallel.h"
#include "model/config.h"
#include "synthetic/synthetic.h"

namespace wsync::e2e {

using nlohmann::json;

// ---- HTTP -----------------------------------------------------------------------------

::testing::AssertionResult IsError(const HttpReply& r, int status, const std::vector<std::string>& needles) {
  if (r.status != status) {
    return ::testing::AssertionFailure() << "want " << status << ", got " << r.Describe();
  }
  std::string msg = r.ErrorMessage();
  if (msg.empty()) {
    return ::testing::AssertionFailure() << "no {\"error\":{\"message\":...}} in " << r.Describe();
  }
  for (const std::string& n : needles) {
    if (msg.find(n) == std::string::npos) {
      return ::testing::AssertionFailure() << "message does not name '" << n << "': " << msg;
    }
  }
  return ::testing::AssertionSuccess();
}

std::string HttpReply::ErrorMessage() const {
  if (!json.is_object()) return "";
  auto e = json.find("error");
  if (e == json.end() || !e->is_object()) return "";
  auto m = e->find("message");
  return m != e->end() && m->is_string() ? m->get<std::string>() : "";
}

std::string HttpReply::Describe() const {
  if (status == 0) return "no reply: " + transport_error;
  return fmt::format("-> {}: {}", status, body.size() > 2000 ? body.substr(0, 2000) + "..." : body);
}

namespace {

HttpReply Send(const std::string& url, const std::string& method, const std::string& path,
               const std::string* body, const std::string& api_key, double timeout_seconds) {
  httplib::Client cli(url);
  auto secs = static_cast<time_t>(timeout_seconds);
  cli.set_connection_timeout(10, 0);
  cli.set_read_timeout(secs, 0);
  cli.set_write_timeout(secs, 0);
  cli.set_keep_alive(false);
  httplib::Headers headers;
  if (!api_key.empty()) headers.emplace("Authorization", "Bearer " + api_key);
  httplib::Result r = method == "GET" ? cli.Get(path, headers)
                                      : cli.Post(path, headers, *body, "application/json");
  HttpReply reply;
  if (!r) {
    reply.transport_error = fmt::format("{} {}{}: {}", method, url, path, httplib::to_string(r.error()));
    return reply;
  }
  reply.status = r->status;
  reply.body = r->body;
  reply.json = json::parse(reply.body, nullptr, /*allow_exceptions=*/false);
  return reply;
}

}  // namespace

HttpReply HttpGet(const std::string& url, const std::string& path, const std::string& api_key,
                  double timeout_seconds) {
  return Send(url, "GET", path, nullptr, api_key, timeout_seconds);
}

HttpReply HttpPost(const std::string& url, const std::string& path, const std::string& body,
                   const std::string& api_key, double timeout_seconds) {
  return Send(url, "POST", path, &body, api_key, timeout_seconds);
}

// ---- digests --------------------------------------------------------------------------

Digests DigestTensors(const std::vector<HostTensor>& tensors, DigestAlgorithm algorithm) {
  std::vector<std::string> hex(tensors.size());
  ParallelFor(tensors.size(), DefaultThreads(), [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) hex[i] = HexDigest(algorithm, tensors[i].ref().bytes);
  });
  Digests out;
  for (size_t i = 0; i < tensors.size(); ++i) out[tensors[i].meta.name] = std::move(hex[i]);
  return out;
}

Result<Digests> ExpectedSyntheticDigests(std::string_view model, uint64_t seed, int steps,
                                         DigestAlgorithm algorithm) {
  WSYNC_ASSIGN_OR_RETURN(ModelConfig config, LookupModel(model));
  WSYNC_ASSIGN_OR_RETURN(auto trainer,
                         SyntheticTrainer::FromMetadata(HfTensors(config), seed, DefaultThreads()));
  for (int s = 1; s <= steps; ++s) {
    WSYNC_RETURN_IF_ERROR(trainer->Step(static_cast<uint64_t>(s)).status());
  }
  return DigestTensors(trainer->tensors(), algorithm);
}

Result<Digests> ServerChecksums(const std::string& url, DigestAlgorithm algorithm,
                                const std::string& api_key) {
  json req{{"action", "checksum"}, {"algorithm", std::string(DigestAlgorithmName(algorithm))}};
  HttpReply r = HttpPost(url, "/weight_checker", req.dump(), api_key, /*timeout_seconds=*/300);
  if (r.status != 200) return Internal(fmt::format("{} POST /weight_checker {}", url, r.Describe()));
  if (!r.json.is_object() || !r.json.contains("checksums") || !r.json["checksums"].is_object()) {
    return Internal(fmt::format("{} POST /weight_checker: no \"checksums\" object in {}", url, r.body.substr(0, 500)));
  }
  Digests out;
  for (const auto& [name, hex] : r.json["checksums"].items()) {
    if (!hex.is_string()) return Internal(fmt::format("{}: checksum of {} is not a string", url, name));
    out[name] = hex.get<std::string>();
  }
  return out;
}

::testing::AssertionResult DigestsEqual(const Digests& expected, const Digests& actual) {
  std::vector<std::string> missing, extra, differ;
  for (const auto& [name, hex] : expected) {
    auto it = actual.find(name);
    if (it == actual.end()) {
      missing.push_back(name);
    } else if (it->second != hex) {
      differ.push_back(fmt::format("{} (want {}, got {})", name, hex, it->second));
    }
  }
  for (const auto& [name, _] : actual) {
    if (!expected.count(name)) extra.push_back(name);
  }
  if (missing.empty() && extra.empty() && differ.empty()) return ::testing::AssertionSuccess();
  auto head = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 5; ++i) s += "\n    " + v[i];
    if (v.size() > 5) s += fmt::format("\n    ... and {} more", v.size() - 5);
    return s;
  };
  return ::testing::AssertionFailure()
         << expected.size() << " expected tensors, " << actual.size() << " reported; "
         << differ.size() << " differ:" << head(differ) << "\n  " << missing.size()
         << " missing:" << head(missing) << "\n  " << extra.size() << " unexpected:" << head(extra);
}

// ---- CLI output -----------------------------------------------------------------------

namespace {

std::string Trim(std::string_view s) {
  size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string_view::npos) return "";
  size_t e = s.find_last_not_of(" \t\r");
  return std::string(s.substr(b, e - b + 1));
}

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::vector<std::string> SplitCells(const std::string& line, bool pipes) {
  std::vector<std::string> cells;
  if (pipes) {
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, '|')) cells.push_back(Trim(cell));
    if (!cells.empty() && cells.front().empty()) cells.erase(cells.begin());
    if (!cells.empty() && cells.back().empty()) cells.pop_back();
  } else {
    std::stringstream ss(line);
    std::string cell;
    while (ss >> cell) cells.push_back(cell);
  }
  return cells;
}

bool IsSeparator(const std::string& line) {
  return !Trim(line).empty() && line.find_first_not_of("-=+|: \t\r") == std::string::npos;
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) lines.push_back(line);
  return lines;
}

}  // namespace

std::optional<TextTable> FindTable(const std::string& text, std::string_view column) {
  std::vector<std::string> lines = Lines(text);
  std::string want = Lower(std::string(column));
  for (size_t i = 0; i < lines.size(); ++i) {
    bool pipes = lines[i].find('|') != std::string::npos;
    std::vector<std::string> header = SplitCells(lines[i], pipes);
    if (std::none_of(header.begin(), header.end(),
                     [&](const std::string& c) { return Lower(c) == want; })) {
      continue;
    }
    TextTable table{header, {}};
    for (size_t j = i + 1; j < lines.size(); ++j) {
      if (Trim(lines[j]).empty()) break;
      if (IsSeparator(lines[j])) continue;
      std::vector<std::string> cells = SplitCells(lines[j], pipes);
      if (cells.size() != header.size()) break;
      table.rows.push_back(std::move(cells));
    }
    return table;
  }
  return std::nullopt;
}

::testing::AssertionResult HasVerifiedTable(const std::string& text, size_t syncs) {
  std::optional<TextTable> table = FindTable(text, "verified");
  if (!table) return ::testing::AssertionFailure() << "no table with a 'verified' column in:\n" << text;
  size_t col = 0;
  while (Lower(table->header[col]) != "verified") ++col;
  if (table->rows.size() != syncs) {
    return ::testing::AssertionFailure() << "table has " << table->rows.size() << " rows, want "
                                         << syncs << " (one per sync):\n" << text;
  }
  static const char* kYes[] = {"yes", "ok", "true", "pass", "passed", "verified", "\u2713", "\u2714"};
  for (size_t r = 0; r < table->rows.size(); ++r) {
    std::string cell = Lower(table->rows[r][col]);
    if (std::none_of(std::begin(kYes), std::end(kYes), [&](const char* y) { return cell == y; })) {
      return ::testing::AssertionFailure() << "row " << r << " has verified='" << table->rows[r][col]
                                           << "':\n" << text;
    }
  }
  return ::testing::AssertionSuccess();
}

std::vector<std::string> InlineCells(const std::string& out) {
  std::vector<std::string> cells;
  std::optional<TextTable> t = FindTable(out, "inline");
  if (!t) return cells;
  size_t col = 0;
  while (col < t->header.size() && t->header[col] != "inline") ++col;
  for (const auto& row : t->rows) cells.push_back(col < row.size() ? row[col] : "");
  return cells;
}

size_t TensorCount(const std::string& model) {
  Result<ModelConfig> c = LookupModel(model);
  return c.ok() ? HfTensors(*c).size() : 0;
}

// ---- processes ------------------------------------------------------------------------

void E2eTest::SetUp() {
  // ctest sets WSYNC_BIN; run by hand, the binary sits at <build>/tools/wsync beside
  // this test's <build>/tests/e2e/.
  const char* bin = std::getenv("WSYNC_BIN");
  if (bin && *bin) {
    binary_ = bin;
  } else {
    std::error_code ec;
    std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
    binary_ = (self.parent_path() / "../../tools/wsync").lexically_normal().string();
  }
  ASSERT_TRUE(std::filesystem::is_regular_file(binary_))
      << "no wsync binary at " << binary_ << ": build the `wsync` target first";
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = fmt::format("{}.{}", info->test_suite_name(), info->name());
  std::replace(name.begin(), name.end(), '/', '_');
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = fmt::format("{}/wsync-e2e-{}-XXXXXX", tmp && *tmp ? tmp : "/tmp", name);
  ASSERT_NE(mkdtemp(pattern.data()), nullptr) << "mkdtemp " << pattern;
  dir_ = pattern;
}

void E2eTest::TearDown() {
  // Stop in reverse start order: trainers before the servers they talk to.
  for (auto it = procs_.rbegin(); it != procs_.rend(); ++it) (*it)->Stop();
  procs_.clear();
  if (dir_.empty()) return;
  if (HasFailure()) {
    std::cerr << "[e2e] logs of this test are kept in " << dir_ << "\n";
  } else {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

Result<Subprocess*> E2eTest::SpawnWsync(const std::string& name, std::vector<std::string> args,
                                        std::map<std::string, std::string> env) {
  SpawnOptions o;
  o.args = std::move(args);
  o.stdout_path = dir_ / (name + ".stdout");
  o.stderr_path = dir_ / (name + ".stderr");
  o.env = std::move(env);
  // A developer's shell must not change a test's outcome: pass a key through `env`.
  o.unset_env = {"WSYNC_API_KEY"};
  // Whatever the child puts under $TMPDIR (demo's server logs) lives and dies with the test.
  o.env.emplace("TMPDIR", dir_.string());
  WSYNC_ASSIGN_OR_RETURN(auto p, Subprocess::Spawn(binary_, std::move(o)));
  procs_.push_back(std::move(p));
  return procs_.back().get();
}

Result<Server> E2eTest::StartServer(const std::string& name, std::vector<std::string> args,
                                    std::map<std::string, std::string> env, double ready_seconds) {
  std::filesystem::path ready = dir_ / (name + ".url");
  std::vector<std::string> full = {"serve", "--host", "127.0.0.1", "--port", "0",
                                   "--ready-file", ready.string()};
  full.insert(full.end(), args.begin(), args.end());
  WSYNC_ASSIGN_OR_RETURN(Subprocess * p, SpawnWsync(name, std::move(full), std::move(env)));
  Deadline deadline = Deadline::InSeconds(ready_seconds);
  std::string url;
  while (url.empty()) {
    if (!p->Running()) {
      return Unavailable(fmt::format("server {} exited before writing its ready file:\n{}", name,
                                     p->Describe()));
    }
    if (deadline.expired()) {
      return DeadlineExceeded(fmt::format("server {} wrote no ready file {} within {} s:\n{}",
                                          name, ready.string(), ready_seconds, p->Describe()));
    }
    if (std::filesystem::exists(ready)) {
      url = ReadFileOrEmpty(ready);
      while (!url.empty() && std::isspace(static_cast<unsigned char>(url.back()))) url.pop_back();
    }
    if (url.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (url.rfind("http://127.0.0.1:", 0) != 0) {
    return Internal(fmt::format("server {} ready file holds '{}', want http://127.0.0.1:PORT", name, url));
  }
  // The ready file is written once listening, so /health must answer at once.
  HttpReply health = HttpGet(url, "/health", "", 10);
  if (health.status != 200) {
    return Unavailable(fmt::format("server {} at {}: GET /health {}\n{}", name, url,
                                   health.Describe(), p->Describe()));
  }
  return Server{name, url, p};
}

RunResult E2eTest::RunWsync(const std::string& name, std::vector<std::string> args,
                            double timeout_seconds, std::map<std::string, std::string> env) {
  RunResult r;
  auto start = std::chrono::steady_clock::now();
  Result<Subprocess*> p = SpawnWsync(name, std::move(args), std::move(env));
  if (!p.ok()) {
    r.description = p.status().ToString();
    return r;
  }
  std::optional<ExitStatus> st = (*p)->Wait(Deadline::InSeconds(timeout_seconds));
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!st) {
    r.timed_out = true;
    st = (*p)->Stop();
  }
  r.exit = *st;
  r.out = (*p)->Stdout();
  r.err = (*p)->Stderr();
  r.description = (*p)->Describe();
  if (r.timed_out) r.description += fmt::format("\n(killed by the test after {} s)", timeout_seconds);
  return r;
}

RunResult E2eTest::Push(const std::string& name, const std::vector<Server>& servers,
                        std::vector<std::string> args, double timeout_seconds) {
  std::vector<std::string> full = {"push", "--servers", JoinUrls(servers)};
  if (std::find(args.begin(), args.end(), "--backend") == args.end()) {
    full.insert(full.end(), {"--backend", "nccl"});
  }
  full.insert(full.end(), args.begin(), args.end());
  return RunWsync(name, std::move(full), timeout_seconds);
}

void E2eTest::ExpectServersHold(const std::vector<Server>& servers, const Digests& expected,
                                DigestAlgorithm algorithm, const std::string& api_key) {
  for (const Server& s : servers) {
    Result<Digests> got = ServerChecksums(s.url, algorithm, api_key);
    ASSERT_TRUE(got.ok()) << s.name << ": " << got.status().ToString();
    EXPECT_TRUE(DigestsEqual(expected, *got))
        << "server " << s.name << " (" << s.url << "), " << DigestAlgorithmName(algorithm);
  }
}

void E2eTest::ExpectRefusedInLine(const RunResult& push, const Server& server, const std::string& tensor) {
  ASSERT_FALSE(push.success()) << push.description;
  EXPECT_NE(push.err.find(tensor), std::string::npos) << push.description;
  EXPECT_NE(push.err.find("in-line verification"), std::string::npos) << push.description;
  HttpReply h = HttpGet(server.url, "/health");
  EXPECT_EQ(h.json.value("weights_consistent", true), false) << h.Describe();
  EXPECT_EQ(h.json.value("weight_version", ""), "default") << h.Describe();
}

void E2eTest::ExpectCleanShutdown(const Server& server, int sig) {
  server.process->Signal(sig);
  std::optional<ExitStatus> st = server.process->Wait(Deadline::InSeconds(15));
  ASSERT_TRUE(st.has_value()) << "server " << server.name << " still running 15 s after "
                              << strsignal(sig) << "\n" << server.process->Describe();
  EXPECT_TRUE(st->success()) << "server " << server.name << " after " << strsignal(sig) << ": "
                             << server.process->Describe();
}

std::string E2eTest::JoinUrls(const std::vector<Server>& servers) {
  std::string s;
  for (const Server& v : servers) s += (s.empty() ? "" : ",") + v.url;
  return s;
}

}  // namespace wsync::e2e
