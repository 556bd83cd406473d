#include "backends/delta/confined_dir.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "backends/delta/testing.h"

namespace wsync::delta {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

void Write(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }

class ConfinedDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(fs::path(tmp_.path()) / "root" / "sub");
    Write(fs::path(tmp_.path()) / "root" / "sub" / "file", "inside");
    Write(fs::path(tmp_.path()) / "secret", "SECRET-BYTES");
  }
  std::string root() const { return tmp_ / "root"; }
  TempDir tmp_{"confined"};
};

TEST_F(ConfinedDirTest, ReadsRegularFilesBelowAndFollowsSymlinksThatStayInside) {
  auto d = ConfinedDir::Open(root());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  auto text = d->ReadFile("sub/file", 100);
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_EQ(*text, "inside");
  fs::create_symlink("sub/file", fs::path(root()) / "link");
  EXPECT_EQ(*d->ReadFile("link", 100), "inside");
  auto sub = d->OpenDir("sub");
  ASSERT_TRUE(sub.ok());
  EXPECT_EQ(*sub->ReadFile("file", 100), "inside");
  EXPECT_EQ(sub->path(), root() + "/sub");
}

TEST_F(ConfinedDirTest, RefusesEveryWayOutWithoutQuotingBytes) {
  auto d = ConfinedDir::Open(root());
  ASSERT_TRUE(d.ok());
  fs::create_symlink(tmp_ / "secret", fs::path(root()) / "abs");
  fs::create_symlink("../secret", fs::path(root()) / "rel");
  fs::create_symlink("/dev/zero", fs::path(root()) / "zero");
  fs::create_symlink("/proc/self/root/etc/passwd", fs::path(root()) / "magic");
  fs::create_directory_symlink(tmp_.path(), fs::path(root()) / "up");
  for (const char* rel : {"abs", "rel", "zero", "magic", "../secret", "sub/../../secret", "up/secret", "/etc/passwd"}) {
    SCOPED_TRACE(rel);
    auto r = d->ReadFile(rel, 1 << 20);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    EXPECT_EQ(r.status().message().find("SECRET"), std::string::npos);
  }
  EXPECT_FALSE(d->OpenDir("up").ok());
  EXPECT_FALSE(d->OpenDir("..").ok());
}

// Where openat2 is missing: the O_NOFOLLOW walk refuses every symlink, even one that
// stays inside, and every way out.
TEST_F(ConfinedDirTest, TheWalkWithoutOpenat2RefusesEverySymlink) {
  bool was = ConfinedDir::UseWalkForTesting(true);
  auto d = ConfinedDir::Open(root());
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*d->ReadFile("sub/file", 100), "inside");
  EXPECT_EQ(*d->OpenDir("sub")->ReadFile("file", 100), "inside");
  fs::create_symlink("sub/file", fs::path(root()) / "link");
  fs::create_symlink(tmp_ / "secret", fs::path(root()) / "abs");
  fs::create_directory_symlink(tmp_.path(), fs::path(root()) / "up");
  for (const char* rel : {"link", "abs", "../secret", "sub/../../secret", "up/secret"}) {
    SCOPED_TRACE(rel);
    auto r = d->ReadFile(rel, 1 << 20);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  }
  EXPECT_FALSE(d->OpenDir("up").ok());
  ConfinedDir::UseWalkForTesting(was);
}

TEST_F(ConfinedDirTest, AFifoOrADeviceIsRefusedAtOnce) {
  ASSERT_EQ(::mkfifo((fs::path(root()) / "fifo").c_str(), 0644), 0);
  auto d = ConfinedDir::Open(root());
  auto t0 = std::chrono::steady_clock::now();
  auto r = d->ReadFile("fifo", 100);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("not a regular file"), std::string::npos) << r.status().ToString();
  auto dev = ConfinedDir::Open("/dev");
  ASSERT_TRUE(dev.ok());
  auto z = dev->ReadFile("zero", 100);
  ASSERT_FALSE(z.ok());
  EXPECT_NE(z.status().message().find("not a regular file"), std::string::npos);
  auto own = ReadRegularFile((fs::path(root()) / "fifo").string(), 100);
  EXPECT_FALSE(own.ok());
}

TEST_F(ConfinedDirTest, AFileOverTheLimitIsRefusedBeforeItIsRead) {
  fs::path big = fs::path(root()) / "big";
  Write(big, "");
  ASSERT_EQ(::truncate(big.c_str(), off_t{1} << 30), 0);  // sparse: no disk
  auto d = ConfinedDir::Open(root());
  auto r = d->ReadFile("big", 1 << 20);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("limit"), std::string::npos) << r.status().ToString();
  EXPECT_FALSE(ReadRegularFile(big.string(), 1 << 20).ok());
}

TEST_F(ConfinedDirTest, ReadRegularFileRefusesASymlink) {
  fs::path link = fs::path(root()) / "state-link";
  fs::create_symlink(tmp_ / "secret", link);
  auto r = ReadRegularFile(link.string(), 100);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().find("SECRET"), std::string::npos);
}

TEST(PathBelowTest, KeepsRequestsBelowTheRoot) {
  EXPECT_EQ(*PathBelow("/srv/root", "/srv/root/sync"), "sync");
  EXPECT_EQ(*PathBelow("/srv/root/", "/srv/root/a/b/"), "a/b");
  EXPECT_EQ(*PathBelow("/srv/root", "/srv/root"), "");
  EXPECT_EQ(*PathBelow("/srv/root", "/srv/root/a/../b"), "b");
  EXPECT_EQ(*PathBelow("/srv/root", "a/./b"), "a/b");
  for (const char* bad : {"/srv/rootx/a", "/srv/root/../etc", "/etc/passwd", "../x", "a/../../x", "..", ""}) {
    SCOPED_TRACE(bad);
    auto r = PathBelow("/srv/root", bad);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_FALSE(PathBelow("/srv/root", std::string("a\0b", 3)).ok());
}

TEST(IsPlainFileNameTest, OneComponentNotHidden) {
  EXPECT_TRUE(IsPlainFileName("delta-rank00000-file000000.safetensors"));
  for (const char* bad : {"", ".", "..", "../../etc/passwd", "a/b", "/abs", ".hidden"}) {
    EXPECT_FALSE(IsPlainFileName(bad)) << bad;
  }
}

}  // namespace
}  // namespace wsync::delta
