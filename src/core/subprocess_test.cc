#include "core/subprocess.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include <gtest/gtest.h>

#include "core/syscall.h"

namespace wsync {
namespace {

class SubprocessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("wsync-subprocess-test-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::unique_ptr<Subprocess> Shell(const std::string& script, SpawnOptions o = {}) {
    o.args = {"-c", script};
    auto p = Subprocess::Spawn("/bin/sh", std::move(o));
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? std::move(*p) : nullptr;
  }

  std::filesystem::path dir_;
};

TEST_F(SubprocessTest, OutputGoesToFilesAndTheExitCodeComesBack) {
  SpawnOptions o;
  o.stdout_path = dir_ / "out";
  o.stderr_path = dir_ / "err";
  auto p = Shell("echo to-out; echo to-err >&2; exit 3", o);
  auto st = p->Wait(Deadline::InSeconds(30));
  ASSERT_TRUE(st.has_value());
  EXPECT_TRUE(st->exited);
  EXPECT_EQ(st->code, 3);
  EXPECT_EQ(st->ShellCode(), 3);
  EXPECT_EQ(st->ToString(), "exit 3");
  EXPECT_EQ(p->Stdout(), "to-out\n");
  EXPECT_EQ(p->Stderr(), "to-err\n");
  EXPECT_NE(p->Describe().find("to-err"), std::string::npos);
  EXPECT_NE(p->CommandLine().find("'echo to-out; echo to-err >&2; exit 3'"), std::string::npos) << p->CommandLine();
}

TEST_F(SubprocessTest, OneFileCanTakeBothStreams) {
  SpawnOptions o;
  o.stdout_path = o.stderr_path = dir_ / "log";
  auto p = Shell("echo a; echo b >&2; echo c", o);
  ASSERT_TRUE(p->Wait(Deadline::InSeconds(30)).has_value());
  EXPECT_EQ(ReadFileOrEmpty(dir_ / "log"), "a\nb\nc\n");
}

TEST_F(SubprocessTest, CapturedStdoutLargerThanAPipeDoesNotBlockTheChild) {
  SpawnOptions o;
  o.capture_stdout = true;
  // 1 MiB of output: more than a pipe holds, so Wait must drain as it waits.
  auto p = Shell("head -c 1048576 /dev/zero | tr '\\0' x; echo; echo END", o);
  auto st = p->Wait(Deadline::InSeconds(30));
  ASSERT_TRUE(st.has_value());
  EXPECT_TRUE(st->success());
  EXPECT_EQ(p->Stdout().size(), 1048576u + 5);
  EXPECT_EQ(p->Stdout().substr(p->Stdout().size() - 4), "END\n");
}

TEST_F(SubprocessTest, TheEnvironmentIsInheritedSetAndUnset) {
  ::setenv("WSYNC_SUBPROCESS_TEST_KEEP", "kept", 1);
  ::setenv("WSYNC_SUBPROCESS_TEST_DROP", "dropped", 1);
  SpawnOptions o;
  o.capture_stdout = true;
  o.env = {{"WSYNC_SUBPROCESS_TEST_SET", "set"}};
  o.unset_env = {"WSYNC_SUBPROCESS_TEST_DROP"};
  auto p = Shell("echo $WSYNC_SUBPROCESS_TEST_KEEP/$WSYNC_SUBPROCESS_TEST_SET/$WSYNC_SUBPROCESS_TEST_DROP", o);
  ASSERT_TRUE(p->Wait(Deadline::InSeconds(30)).has_value());
  EXPECT_EQ(p->Stdout(), "kept/set/\n");
}

TEST_F(SubprocessTest, WaitGivesUpAtItsDeadlineAndStopKillsTheWholeGroup) {
  SpawnOptions o;
  o.stdout_path = dir_ / "pid";
  // The grandchild ignores SIGTERM; only the group-wide SIGKILL ends it.
  auto p = Shell("sh -c 'trap \"\" TERM; echo $$; exec sleep 300' & wait", o);
  EXPECT_FALSE(p->Wait(Deadline::InSeconds(0.2)).has_value());
  EXPECT_TRUE(p->Running());
  pid_t grandchild = 0;
  for (Deadline d = Deadline::InSeconds(30); grandchild == 0 && !d.expired();) {
    grandchild = std::atoi(ReadFileOrEmpty(dir_ / "pid").c_str());
  }
  ASSERT_GT(grandchild, 0);
  ExitStatus st = p->Stop(std::chrono::milliseconds(200));
  EXPECT_FALSE(st.exited);
  EXPECT_EQ(st.signal, SIGTERM);
  Deadline d = Deadline::InSeconds(10);
  while (::kill(grandchild, 0) == 0 && !d.expired()) {
  }
  EXPECT_NE(::kill(grandchild, 0), 0) << "grandchild " << grandchild << " survived";
  EXPECT_EQ(p->Stop().signal, SIGTERM);  // idempotent
}

TEST_F(SubprocessTest, ForkRunsAFunctionInAChild) {
  int here = 5;
  auto p = Subprocess::Fork([&] { return here + 37; });
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  auto st = (*p)->Wait(Deadline::InSeconds(30));
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->code, 42);
}

TEST_F(SubprocessTest, AMissingBinaryExits127) {
  SpawnOptions o;
  o.stderr_path = dir_ / "err";
  auto p = Subprocess::Spawn((dir_ / "no-such-binary").string(), o);
  ASSERT_TRUE(p.ok());
  auto st = (*p)->Wait(Deadline::InSeconds(30));
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->code, 127);
  EXPECT_NE((*p)->Stderr().find("execve"), std::string::npos);
}

TEST_F(SubprocessTest, AnUnwritableOutputPathIsAnErrorNamingIt) {
  SpawnOptions o;
  o.stdout_path = dir_ / "no-such-dir" / "out";
  auto p = Subprocess::Spawn("/bin/true", o);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kNotFound);
  EXPECT_NE(p.status().message().find("no-such-dir/out"), std::string::npos) << p.status().ToString();
}

TEST(Syscall, ErrnoStatusNamesWhatAndMapsTheCode) {
  Status s = ErrnoStatus(ENOENT, "opening /x");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "opening /x: No such file or directory");
  EXPECT_EQ(ErrnoStatus(EIO, "reading /x").code(), StatusCode::kInternal);
  EXPECT_EQ(ErrnoStatus(EACCES, "opening /x", StatusCode::kInvalidArgument).code(), StatusCode::kInvalidArgument);
  auto fails = []() -> Status {
    WSYNC_SYSCALL(::close(-1), "closing nothing");
    return Status::Ok();
  };
  Status c = fails();
  EXPECT_NE(c.message().find("closing nothing (::close(-1) at "), std::string::npos) << c.message();
  EXPECT_NE(c.message().find("Bad file descriptor"), std::string::npos) << c.message();
  int calls = 0;
  EXPECT_EQ(RetryOnEintr([&] {
              errno = EINTR;
              return ++calls < 3 ? -1 : 7;
            }),
            7);
  EXPECT_EQ(calls, 3);
}

}  // namespace
}  // namespace wsync
