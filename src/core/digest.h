// Digests of tensor bytes for bit-exact verification: sha256 (OpenSSL) and xxh3-128
// (libxxhash), both as lowercase hex. xxh3-128 is printed in its canonical big-endian
// form, matching Python's xxhash.xxh3_128_hexdigest(). A Hasher is single-threaded;
// separate Hashers may run on separate threads.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "wsync/status.h"

namespace wsync {

enum class DigestAlgorithm { kSha256, kXxh3_128 };

// "sha256" or "xxh3_128" (also "xxh3-128"); other names are InvalidArgument.
Result<DigestAlgorithm> ParseDigestAlgorithm(std::string_view name);
std::string_view DigestAlgorithmName(DigestAlgorithm algorithm);

class Hasher {
 public:
  static std::unique_ptr<Hasher> Create(DigestAlgorithm algorithm);
  virtual ~Hasher() = default;
  virtual void Update(std::span<const std::byte> bytes) = 0;
  // Lowercase hex of the digest; the Hasher must not be used afterwards.
  virtual std::string FinishHex() = 0;
};

std::string HexDigest(DigestAlgorithm algorithm, std::span<const std::byte> bytes);

}  // namespace wsync
