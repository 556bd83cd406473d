// The shared ground of the end-to-end tests: a gtest fixture that starts real `wsync`
// processes on loopback, raw HTTP helpers, and the test's own expected digests.
//
// Every test gets a fresh temp directory for the logs, ready files and checkpoints of
// its processes; TearDown() stops every process the test started (SIGTERM, then SIGKILL)
// and removes the directory unless the test failed, in which case the path is printed.
// Children get TMPDIR set to that directory. The binary is $WSYNC_BIN (set by ctest),
// else <build>/tools/wsync. Expected digests never come from the CLI: the test rebuilds
// the trainer's weights itself (SyntheticTrainer with the same model, seed and steps, or
// the checkpoint's bytes) and hashes them with core/digest.h, then compares them with
// /weight_checker of every server. Single-threaded, like gtest.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/digest.h"
#include "core/subprocess.h"
#include "testing/status_matchers.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync::e2e {

// HF tensor name -> lowercase hex digest.
using Digests = std::map<std::string, std::string>;

// ---- HTTP -----------------------------------------------------------------------------

struct HttpReply {
  int status = 0;       // HTTP status; 0 when no reply came (see transport_error)
  std::string body;
  nlohmann::json json;  // the parsed body; discarded (is_discarded()) when not JSON
  std::string transport_error;

  // body["error"]["message"], or "" when the body has none.
  std::string ErrorMessage() const;
  // "-> 400: {...}" (body cut to 2000 bytes), for assertion messages.
  std::string Describe() const;
};

// `r` is HTTP `status` with a JSON error ({"error": {"message": ...}}) whose message
// contains every one of `needles`.
::testing::AssertionResult IsError(const HttpReply& r, int status, const std::vector<std::string>& needles);

// One request on a fresh connection. `api_key` non-empty adds `Authorization: Bearer KEY`.
HttpReply HttpGet(const std::string& url, const std::string& path, const std::string& api_key = "",
                  double timeout_seconds = 60);
HttpReply HttpPost(const std::string& url, const std::string& path, const std::string& body,
                   const std::string& api_key = "", double timeout_seconds = 60);
inline HttpReply HttpPostJson(const std::string& url, const std::string& path,
                              const nlohmann::json& body, const std::string& api_key = "") {
  return HttpPost(url, path, body.dump(), api_key);
}

// ---- digests --------------------------------------------------------------------------

// The digest of every tensor's bytes.
Digests DigestTensors(const std::vector<HostTensor>& tensors, DigestAlgorithm algorithm);
// What every server must hold after `wsync push --model MODEL --seed SEED --steps STEPS`:
// SyntheticTrainer::FromMetadata(HfTensors(LookupModel(model)), seed) after Step(1..steps).
Result<Digests> ExpectedSyntheticDigests(std::string_view model, uint64_t seed, int steps,
                                         DigestAlgorithm algorithm);
// POST /weight_checker {"action":"checksum","algorithm":...} -> {"checksums": {...}}.
Result<Digests> ServerChecksums(const std::string& url, DigestAlgorithm algorithm,
                                const std::string& api_key = "");
// Equal maps; otherwise names the first few missing, extra and differing tensors.
::testing::AssertionResult DigestsEqual(const Digests& expected, const Digests& actual);

// ---- CLI output -----------------------------------------------------------------------

// A table printed by the CLI: a header row and the data rows under it. Cells are split on
// '|' when the header has one, else on whitespace; separator lines (-, =, +, |, :) are
// skipped; the table ends at a blank line or a row with a different number of cells.
struct TextTable {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
};
// The first table whose header has a cell equal to `column` (case-insensitive).
std::optional<TextTable> FindTable(const std::string& text, std::string_view column);
// The text has a table with a "verified" column and exactly `syncs` rows, each verified
// (yes / ok / true / pass / a check mark).
::testing::AssertionResult HasVerifiedTable(const std::string& text, size_t syncs);
// The "inline" cell of every data row of push's table ("verified servers/servers:tensors",
// or "off").
std::vector<std::string> InlineCells(const std::string& out);
// How many Hugging Face tensors `model` has (0 for an unknown model).
size_t TensorCount(const std::string& model);

// ---- processes ------------------------------------------------------------------------

struct Server {
  std::string name;
  std::string url;  // "http://127.0.0.1:PORT", read from --ready-file
  Subprocess* process = nullptr;
};

struct RunResult {
  ExitStatus exit;
  bool timed_out = false;  // killed at the test's deadline
  double seconds = 0;      // wall time from spawn to exit
  std::string out;
  std::string err;
  std::string description;  // command line, exit status and output tails

  bool success() const { return !timed_out && exit.success(); }
};

class E2eTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

  const std::filesystem::path& dir() const { return dir_; }
  const std::string& binary() const { return binary_; }

  // Spawns `wsync ARGS...` with logs dir()/NAME.stdout and dir()/NAME.stderr; the
  // process is stopped in TearDown() if still running.
  Result<Subprocess*> SpawnWsync(const std::string& name, std::vector<std::string> args,
                                 std::map<std::string, std::string> env = {});
  // `wsync serve --host 127.0.0.1 --port 0 --ready-file dir()/NAME.url ARGS...`; waits
  // (up to `ready_seconds`) for the ready file and for GET /health to answer 200. Fails
  // at once, with the server's output, if the process exits first.
  Result<Server> StartServer(const std::string& name, std::vector<std::string> args,
                             std::map<std::string, std::string> env = {},
                             double ready_seconds = 60);
  // Runs `wsync ARGS...` to completion, killing it after `timeout_seconds`.
  RunResult RunWsync(const std::string& name, std::vector<std::string> args,
                     double timeout_seconds, std::map<std::string, std::string> env = {});
  // `wsync push --servers URLS --backend nccl ARGS...` (no --backend nccl when ARGS name a backend).
  RunResult Push(const std::string& name, const std::vector<Server>& servers,
                 std::vector<std::string> args, double timeout_seconds = 120);

  // Every server's /weight_checker equals `expected`.
  void ExpectServersHold(const std::vector<Server>& servers, const Digests& expected,
                         DigestAlgorithm algorithm, const std::string& api_key = "");
  // Sends `sig` (SIGTERM or SIGINT), then expects exit 0 within 15 s (a clean shutdown).
  void ExpectCleanShutdown(const Server& server, int sig = SIGTERM);
  // `push` was refused by `server`'s in-line verification: its error names `tensor` and
  // the check, and the server reports inconsistent weights and still its first version
  // ("default").
  void ExpectRefusedInLine(const RunResult& push, const Server& server, const std::string& tensor);

  static std::string JoinUrls(const std::vector<Server>& servers);

 private:
  std::string binary_;
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<Subprocess>> procs_;
};

// ASSERTs that a Result is OK (printing its Status) and moves its value into `lhs`
// (testing/status_matchers.h's ASSERT_OK_AND_ASSIGN).
#define E2E_ASSERT_OK_AND_ASSIGN(lhs, expr) ASSERT_OK_AND_ASSIGN(lhs, expr)

}  // namespace wsync::e2e
