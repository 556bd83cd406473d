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
#include <vector>

#include "core/xxh3_lanes.h"
#include "wsync/device_runtime.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

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

// Whether `text` is non-empty and all lowercase hex digits, as every digest here prints.
bool IsLowerHex(std::string_view text);

// The secret XXH3_128bits hashes with (seed 0), as libxxhash generates it: what the
// device digest kernel (core/xxh3_lanes.h) is given.
xxh3::Secret Xxh3DefaultSecret();
// The xxh3-128 of `bytes` computed on the host by the device kernel's schedule
// (core/xxh3_lanes.h): XXH3_128bits's value, for device runtimes whose "device" memory is
// host memory (tests).
xxh3::Hash128 Xxh3ByLanes(std::span<const std::byte> bytes);
// The canonical lowercase hex of an xxh3-128 digest (its high word first): what an
// xxh3_128 Hasher's FinishHex() prints.
std::string Xxh3Hex(const xxh3::Hash128& digest);

// The bytes CopyAndHash copies before it hashes them: small enough that they are still in
// the core's nearest caches when the hash reads them, so the hash adds no pass over
// memory to the copy.
inline constexpr size_t kCopyHashBlockBytes = size_t{16} << 10;

// Copies `src` to `dst` (which must not overlap it) block by block, feeding `hasher` each
// block right after copying it: the bytes written at `dst` when `hash_destination` (what
// landed), else the bytes read from `src` (what was read). The digest is the same as one
// Update over the whole of them.
void CopyAndHash(std::byte* dst, std::span<const std::byte> src, Hasher& hasher, bool hash_destination);

// The most bytes of device memory read back into host memory at once to digest it, per
// thread: tensors on a GPU are hashed block by block, never copied whole.
inline constexpr size_t kDeviceReadBackBlockBytes = size_t{16} << 20;

// The digest of `tensor`'s bytes wherever they live: host bytes are hashed in place;
// device bytes are copied back through `scratch` (grown to at most
// kDeviceReadBackBlockBytes and kept) on the calling thread's stream, after making the
// tensor's device current on this thread. Errors name the tensor.
Result<std::string> TensorHexDigest(DigestAlgorithm algorithm, const TensorRef& tensor,
                                    std::vector<std::byte>& scratch);

// The xxh3-128 hex of each of `spans`, device memory of `device`, taken on the device in
// one launch (DeviceRuntime::Xxh3Digests) after making `device` current on this thread.
Result<std::vector<std::string>> DeviceXxh3Hex(const Device& device, std::span<const DeviceRuntime::Span> spans);
// What a DeviceRuntime whose "device" memory is host memory (tests) answers for
// Xxh3Digests: the device kernel's schedule run on the host (Xxh3ByLanes).
Status HostXxh3Digests(std::span<const DeviceRuntime::Span> spans, std::span<uint64_t> out);

}  // namespace wsync
