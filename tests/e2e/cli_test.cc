// The `wsync` command line itself: help texts name the main flags, and bad flags or
// arguments fail fast with a message instead of starting anything.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "e2e_test_base.h"

namespace wsync::e2e {
namespace {

class CliTest : public E2eTest {};

::testing::AssertionResult MentionsAll(const std::string& text, const std::vector<std::string>& words) {
  for (const std::string& w : words) {
    if (text.find(w) == std::string::npos) return ::testing::AssertionFailure() << "no '" << w << "' in:\n" << text;
  }
  return ::testing::AssertionSuccess();
}

TEST_F(CliTest, TopLevelHelpListsSubcommands) {
  RunResult r = RunWsync("help", {"--help"}, 30);
  ASSERT_TRUE(r.success()) << r.description;
  EXPECT_TRUE(MentionsAll(r.out, {"serve", "push", "demo"}));
}

TEST_F(CliTest, PushHelpListsItsFlags) {
  RunResult r = RunWsync("help", {"push", "--help"}, 30);
  ASSERT_TRUE(r.success()) << r.description;
  EXPECT_TRUE(MentionsAll(r.out, {"--servers", "--backend", "--checkpoint", "--model", "--seed",
                                  "--steps", "--data-parallel-size", "--bucket-gb", "--timeout",
                                  "--verify", "--weight-version", "--api-key", "--backend-option",
                                  "--sync-dir", "--ipc-mode", "--nccl-piece-mb"}));
}

TEST_F(CliTest, ServeHelpListsItsFlags) {
  RunResult r = RunWsync("help", {"serve", "--help"}, 30);
  ASSERT_TRUE(r.success()) << r.description;
  EXPECT_TRUE(MentionsAll(r.out, {"--host", "--port", "--model", "--tp", "--dp", "--dp-rank",
                                  "--device", "--backend", "--api-key", "--timeout",
                                  "--ready-file", "--max-body-mb", "--fault"}));
}

TEST_F(CliTest, UnknownFlagsExitNonZeroNamingTheFlag) {
  // Without a subcommand there is nothing to run; any refusal will do.
  RunResult top = RunWsync("bad_flag_top", {"--no-such-flag"}, 30);
  EXPECT_FALSE(top.timed_out) << top.description;
  EXPECT_TRUE(top.exit.exited && top.exit.code != 0) << top.description;
  // With every required flag given, the unknown one is the only error, and is named.
  for (std::vector<std::string> args :
       {std::vector<std::string>{"push", "--servers", "http://127.0.0.1:1", "--model", "qwen3-tiny",
                                 "--no-such-flag"},
        {"serve", "--port", "0", "--no-such-flag"}}) {
    RunResult r = RunWsync("bad_flag_" + args[0], args, 30);
    EXPECT_FALSE(r.timed_out) << r.description;
    EXPECT_TRUE(r.exit.exited && r.exit.code != 0) << r.description;
    EXPECT_NE((r.err + r.out).find("--no-such-flag"), std::string::npos) << r.description;
  }
}

TEST_F(CliTest, ServeWithAnUnknownModelExitsNonZeroNamingIt) {
  RunResult r = RunWsync("serve", {"serve", "--host", "127.0.0.1", "--port", "0", "--model",
                                   "no-such-model"}, 30);
  EXPECT_FALSE(r.timed_out) << r.description;
  EXPECT_TRUE(r.exit.exited && r.exit.code != 0) << r.description;
  EXPECT_NE(r.err.find("no-such-model"), std::string::npos) << r.description;
}

// A config.json nested 100,000 deep is an error naming the file and the field in every
// command that loads a model directory, never a crash.
TEST_F(CliTest, ADeeplyNestedConfigIsAnErrorInEveryCommand) {
  const std::filesystem::path model = dir() / "deep_model";
  std::filesystem::create_directories(model);
  std::ofstream(model / "config.json") << R"({"architectures": ["Qwen3ForCausalLM"], "rope_scaling": )"
                                       << std::string(100000, '[') << std::string(100000, ']') << "}";
  const std::string want = (model / "config.json").string() + ": field 'rope_scaling' nests deeper than 64 levels";
  const std::vector<std::vector<std::string>> commands = {
      {"serve", "--host", "127.0.0.1", "--port", "0", "--model", model.string()},
      {"push", "--servers", "http://127.0.0.1:1", "--model", model.string(), "--timeout", "10"},
      {"plan", "--model", model.string(), "--trainer", "fsdp:8@h800", "--servers", "1x(8,1,1)@h800"},
  };
  for (const std::vector<std::string>& args : commands) {
    RunResult r = RunWsync("deep_" + args[0], args, 60);
    EXPECT_FALSE(r.timed_out) << r.description;
    EXPECT_TRUE(r.exit.exited && r.exit.code != 0) << r.description;  // exited, not killed by a signal
    EXPECT_NE((r.err + r.out).find(want), std::string::npos) << r.description << "\n" << r.err;
  }
}

TEST_F(CliTest, PushToAnUnreachableServerExitsNonZeroNamingIt) {
  // Port 1 on loopback: nothing listens there, the connect is refused at once.
  Server nobody{"nobody", "http://127.0.0.1:1", nullptr};
  RunResult r = Push("push", {nobody}, {"--model", "qwen3-tiny", "--seed", "1", "--timeout", "10"}, 60);
  EXPECT_FALSE(r.timed_out) << r.description;
  EXPECT_TRUE(r.exit.exited && r.exit.code != 0) << r.description;
  EXPECT_NE(r.err.find("127.0.0.1:1"), std::string::npos) << r.description;
}

// `wsync serve` (default --backend nccl) driven by `push --backend ipc`: the trainer
// names the server, the backend it runs and the one asked for, before any init is sent.
TEST_F(CliTest, PushToAServerOfAnotherBackendNamesBoth) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("serve", {"--model", "qwen3-tiny"}));
  RunResult r = RunWsync("push", {"push", "--servers", s.url, "--backend", "ipc", "--model", "qwen3-tiny",
                                  "--seed", "1", "--timeout", "20"}, 60);
  EXPECT_FALSE(r.timed_out) << r.description;
  EXPECT_TRUE(r.exit.exited && r.exit.code != 0) << r.description;
  EXPECT_NE(r.err.find("the trainer asked for backend 'ipc', but " + s.url + " runs backend 'nccl'"),
            std::string::npos) << r.description;
  EXPECT_EQ(r.err.find("unknown field"), std::string::npos) << r.description;
  // Nothing reached the server: it still takes an nccl trainer.
  RunResult ok = Push("push_nccl", {s}, {"--model", "qwen3-tiny", "--seed", "1", "--verify", "--timeout", "20"});
  EXPECT_TRUE(ok.success()) << ok.description;
}

TEST_F(CliTest, PushRefusesABackendOptionTheBackendDoesNotKnow) {
  Server nobody{"nobody", "http://127.0.0.1:1", nullptr};
  RunResult r = Push("push", {nobody}, {"--model", "qwen3-tiny", "--backend-option", "no_such=1"}, 60);
  EXPECT_TRUE(r.exit.exited && r.exit.code != 0) << r.description;
  EXPECT_NE(r.err.find("backend 'nccl' has no option 'no_such' (its options: piece_mb)"), std::string::npos)
      << r.description;
}

}  // namespace
}  // namespace wsync::e2e
