// Which rendezvous store a server may dial: the init request's own peer, loopback for a
// loopback peer, or what --allow-store-host admits.
#include "comm/store_address.h"

#include <gtest/gtest.h>

namespace wsync {
namespace {

TEST(StoreAddress, ThePeerMayNameItself) {
  EXPECT_EQ(*AdmitStoreHost("10.1.2.3", "10.1.2.3", {}), "10.1.2.3");
  EXPECT_EQ(*AdmitStoreHost("10.1.2.3", "::ffff:10.1.2.3", {}), "10.1.2.3");  // v4-mapped peer
  EXPECT_EQ(*AdmitStoreHost("fd00::7", "fd00::7", {}), "fd00::7");
}

TEST(StoreAddress, ALoopbackPeerMayNameLoopback) {
  EXPECT_EQ(*AdmitStoreHost("127.0.0.1", "127.0.0.1", {}), "127.0.0.1");
  EXPECT_EQ(*AdmitStoreHost("127.0.0.5", "127.0.0.1", {}), "127.0.0.5");
  EXPECT_EQ(*AdmitStoreHost("::1", "127.0.0.1", {}), "::1");
  Result<std::string> local = AdmitStoreHost("localhost", "127.0.0.1", {});
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  EXPECT_TRUE(IsLoopbackAddress(*local)) << *local;  // the numeric address, not the name
}

TEST(StoreAddress, OtherHostsAreRefusedNamingTheFlag) {
  Result<std::string> r = AdmitStoreHost("10.9.9.9", "10.1.2.3", {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("'10.9.9.9'"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("(10.1.2.3)"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("--allow-store-host"), std::string::npos) << r.status().message();
  // A remote peer may not point the server at loopback (its own local services).
  EXPECT_FALSE(AdmitStoreHost("127.0.0.1", "10.1.2.3", {}).ok());
  EXPECT_FALSE(AdmitStoreHost("localhost", "10.1.2.3", {}).ok());
  // A loopback peer may not point it at another host.
  EXPECT_FALSE(AdmitStoreHost("10.9.9.9", "127.0.0.1", {}).ok());
  // No peer: only the allow-list admits.
  EXPECT_FALSE(AdmitStoreHost("127.0.0.1", "", {}).ok());
}

TEST(StoreAddress, TheAllowListAdmits) {
  EXPECT_EQ(*AdmitStoreHost("10.9.9.9", "10.1.2.3", {"10.9.9.9"}), "10.9.9.9");
  EXPECT_EQ(*AdmitStoreHost("10.9.9.9", "", {"10.0.0.1", "10.9.9.9"}), "10.9.9.9");
  EXPECT_EQ(*AdmitStoreHost("10.9.9.9", "10.1.2.3", {"*"}), "10.9.9.9");
  EXPECT_FALSE(AdmitStoreHost("10.9.9.8", "10.1.2.3", {"10.9.9.9"}).ok());
}

TEST(StoreAddress, UnresolvableOrHostileHostsAreRefused) {
  EXPECT_FALSE(AdmitStoreHost("", "127.0.0.1", {}).ok());
  EXPECT_FALSE(AdmitStoreHost("host name with spaces", "127.0.0.1", {}).ok());
  EXPECT_FALSE(AdmitStoreHost(std::string(300, 'a'), "127.0.0.1", {}).ok());
  Result<std::string> r = AdmitStoreHost("\xff\xfe", "127.0.0.1", {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().find('\xff'), std::string::npos);  // no raw bytes in the message
}

TEST(StoreAddress, Loopback) {
  EXPECT_TRUE(IsLoopbackAddress("127.0.0.1"));
  EXPECT_TRUE(IsLoopbackAddress("127.255.0.1"));
  EXPECT_TRUE(IsLoopbackAddress("::1"));
  EXPECT_TRUE(IsLoopbackAddress("::ffff:127.0.0.1"));
  EXPECT_FALSE(IsLoopbackAddress("10.0.0.1"));
  EXPECT_FALSE(IsLoopbackAddress("localhost"));  // numeric only
  EXPECT_FALSE(IsLoopbackAddress(""));
}

}  // namespace
}  // namespace wsync
