// Which rendezvous store a server may dial: a literal address (never a name a request
// chose), the init request's own peer, loopback for a loopback peer, or what
// --allow-store-host admits.
#include "comm/store_address.h"

#include <fmt/format.h>
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
  EXPECT_EQ(*AdmitStoreHost("[::1]", "::1", {}), "::1");
  EXPECT_EQ(*AdmitStoreHost("::ffff:127.0.0.1", "127.0.0.1", {}), "127.0.0.1");  // canonical form
}

// A host name in a request is refused before any lookup, even one that would resolve to
// the peer; only literal addresses are compared.
TEST(StoreAddress, RequestHostNamesAreNeverResolved) {
  for (const char* name : {"localhost", "ip6-localhost", "example.com", "10.1.2.3.nip.io", "0x7f000001"}) {
    Result<std::string> r = AdmitStoreHost(name, "127.0.0.1", {});
    ASSERT_FALSE(r.ok()) << name;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), fmt::format("init_info gloo_store_host '{}' is not a literal IPv4 or IPv6 "
                                                "address: a server never resolves a host name a request names; "
                                                "send the address of the trainer's store",
                                                name));
  }
  // Not even when the allow-list names the same host: the request must send the address.
  EXPECT_FALSE(AdmitStoreHost("localhost", "10.1.2.3", {"localhost"}).ok());
  EXPECT_FALSE(AdmitStoreHost("store.example", "10.1.2.3", {"*"}).ok());
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
  // A flag entry may be a name (the operator's choice): its addresses admit.
  EXPECT_EQ(*AdmitStoreHost("127.0.0.1", "10.1.2.3", {"localhost"}), "127.0.0.1");
  EXPECT_FALSE(AdmitStoreHost("10.9.9.9", "10.1.2.3", {"localhost"}).ok());
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
