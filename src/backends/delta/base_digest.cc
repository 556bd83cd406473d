#include "backends/delta/base_digest.h"

#include <vector>

#include <fmt/format.h>

#include "core/digest.h"
#include "core/parallel.h"

namespace wsync::delta {
namespace {

// Bytes hashed (and visited) at once: small enough to stay in L2 for the visitor.
constexpr size_t kDigestBlockBytes = size_t{256} << 10;

}  // namespace

std::string CombineDigests(const TensorDigests& digests) {
  std::unique_ptr<Hasher> h = Hasher::Create(DigestAlgorithm::kXxh3_128);
  for (const auto& [name, hex] : digests) {
    h->Update(std::as_bytes(std::span(name.data(), name.size())));
    h->Update(std::as_bytes(std::span("\0", 1)));
    h->Update(std::as_bytes(std::span(hex.data(), hex.size())));
    h->Update(std::as_bytes(std::span("\n", 1)));
  }
  return h->FinishHex();
}

bool IsDigestHex(std::string_view hex) { return hex.size() == kDigestHexChars && IsLowerHex(hex); }

std::string BaseMismatchFix(const std::string& server_base) {
  return fmt::format("give the trainer the servers' base checkpoint ({} on this server; base_checkpoint=DIR in "
                     "Python, wsync push --base-checkpoint DIR), or start the servers with --base-checkpoint naming "
                     "the trainer's starting weights", server_base);
}

TensorDigests DigestCheckpoint(const CheckpointDir& dir, size_t threads, const DigestVisitor& visit) {
  const std::vector<TensorMeta>& tensors = dir.tensors();
  std::vector<std::string> hex(tensors.size());
  ParallelFor(tensors.size(), threads ? threads : DefaultThreads(), [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      std::span<const std::byte> bytes = *dir.Bytes(tensors[i].name);
      std::unique_ptr<Hasher> h = Hasher::Create(DigestAlgorithm::kXxh3_128);
      for (size_t off = 0; off < bytes.size(); off += kDigestBlockBytes) {
        std::span<const std::byte> block = bytes.subspan(off, std::min(kDigestBlockBytes, bytes.size() - off));
        h->Update(block);
        if (visit) visit(i, off, block);
      }
      hex[i] = h->FinishHex();
    }
  });
  TensorDigests out;
  for (size_t i = 0; i < tensors.size(); ++i) out.emplace(tensors[i].name, std::move(hex[i]));
  return out;
}

Result<std::shared_ptr<const TensorDigests>> BaseDigests::Get() {
  std::lock_guard lock(mu_);
  if (digests_) return digests_;
  Result<CheckpointDir> dir = CheckpointDir::Open(checkpoint_);
  if (!dir.ok()) return dir.status().WithContext("digesting the base checkpoint");
  digests_ = std::make_shared<const TensorDigests>(DigestCheckpoint(*dir, threads_));
  return digests_;
}

}  // namespace wsync::delta
