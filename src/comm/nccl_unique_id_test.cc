#include "comm/nccl_unique_id.h"

#include <gtest/gtest.h>

namespace wsync {
namespace {

NcclUniqueIdBytes Pattern() {
  NcclUniqueIdBytes id;
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<uint8_t>(i * 37 + 251);
  return id;
}

TEST(NcclUniqueId, RoundTripsAsStandardBase64) {
  std::string b64 = EncodeNcclUniqueId(Pattern());
  EXPECT_EQ(b64.size(), 172u);
  EXPECT_EQ(b64.back(), '=');
  EXPECT_EQ(*DecodeNcclUniqueId(b64), Pattern());
}

TEST(NcclUniqueId, KnownEncoding) {
  NcclUniqueIdBytes zeros{};
  // base64.b64encode(bytes(128)): 42 whole groups, then 2 bytes -> "AAA=".
  std::string want(168, 'A');
  want += "AAA=";
  EXPECT_EQ(EncodeNcclUniqueId(zeros), want);
}

TEST(NcclUniqueId, RejectsWhatVllmRejects) {
  std::string good = EncodeNcclUniqueId(Pattern());
  EXPECT_NE(DecodeNcclUniqueId(good.substr(4)).status().message().find("172 characters"), std::string::npos);
  std::string url_safe = good;
  url_safe[10] = '-';
  EXPECT_NE(DecodeNcclUniqueId(url_safe).status().message().find("'-' at position 10"), std::string::npos);
  std::string padded = good;
  padded[170] = '=';
  EXPECT_FALSE(DecodeNcclUniqueId(padded).ok());
  std::string unpadded = good;
  unpadded[171] = 'A';
  EXPECT_FALSE(DecodeNcclUniqueId(unpadded).ok());
}

// Found by nccl_unique_id_fuzz (seed noncanonical-trailing-bits): the last character
// before the padding carries 2 unused bits; text with them set decodes (as Python's
// decoder, vLLM's, takes it) to the same bytes as the canonical spelling.
TEST(NcclUniqueId, UnusedTrailingBitsDecodeToTheCanonicalBytes) {
  std::string good = EncodeNcclUniqueId(Pattern());
  std::string odd = good;
  const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  size_t v = alphabet.find(odd[170]);
  ASSERT_NE(v, std::string::npos);
  odd[170] = alphabet[v | 0x3];  // the 2 unused low bits set
  ASSERT_NE(odd, good);
  Result<NcclUniqueIdBytes> decoded = DecodeNcclUniqueId(odd);
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(*decoded, Pattern());
}

}  // namespace
}  // namespace wsync
