// The identity of a delta chain's base (version 0): which bytes a trainer and a server
// start from, so that they can agree on it before the first delta is applied.
//
// A tensor's digest is the xxh3-128 hex of its bytes in the checkpoint's on-disk dtype
// (what a manifest record's checksum is). The digest of a set of tensors is the
// xxh3-128 hex of the lines "<name>\0<tensor digest>\n", names in byte order. Two
// places carry one:
//   - init_info "base_digest" (wsync servers only): the trainer's base checkpoint, over
//     every tensor of it; the server compares it with its own --base-checkpoint's.
//   - manifest "base_digest" (a version with base_version 0): the trainer's first
//     weights when it was given no base checkpoint, over the tensors of the version's
//     records; every record is an all-zero patch whose checksum is that tensor's digest
//     (a "full version": a server on another base fails its checks instead of applying).
// Pure functions, and BaseDigests, which is thread-safe.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "format/safetensors.h"
#include "wsync/status.h"

namespace wsync::delta {

// Tensor name -> digest.
using TensorDigests = std::map<std::string, std::string, std::less<>>;

// Hex digits of an xxh3-128 digest.
inline constexpr size_t kDigestHexChars = 32;

// The digest of the set `digests` describes.
std::string CombineDigests(const TensorDigests& digests);

// Whether `hex` is kDigestHexChars lowercase hex digits.
bool IsDigestHex(std::string_view hex);

// What to do when the trainer's base and a server's (`server_base`, its flag) differ;
// ends every mismatch message.
std::string BaseMismatchFix(const std::string& server_base);

// Digests of every tensor of a checkpoint, computed once, at the first Get(), on
// `threads` threads (0: every core), then kept: the base is read-only while a server
// runs. Callers of Get() wait for the one computing it.
class BaseDigests {
 public:
  explicit BaseDigests(std::string checkpoint, size_t threads = 0)
      : checkpoint_(std::move(checkpoint)), threads_(threads) {}
  const std::string& checkpoint() const { return checkpoint_; }
  Result<std::shared_ptr<const TensorDigests>> Get();

 private:
  const std::string checkpoint_;
  const size_t threads_;
  std::mutex mu_;
  std::shared_ptr<const TensorDigests> digests_;  // GUARDED_BY(mu_)
};

// Digests of every tensor of an open checkpoint, on `threads` threads; `visit`, when
// given, is called on the hashing thread with each tensor's index in dir.tensors() and
// its bytes, block by block, right after they are hashed (the publisher copies them
// into its snapshot while they are in cache).
using DigestVisitor = std::function<void(size_t tensor, size_t offset, std::span<const std::byte> block)>;
TensorDigests DigestCheckpoint(const CheckpointDir& dir, size_t threads, const DigestVisitor& visit = {});

}  // namespace wsync::delta
