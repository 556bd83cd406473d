#include "core/digest.h"

#include <algorithm>
#include <cstring>

#include <openssl/evp.h>
#define XXH_STATIC_LINKING_ONLY  // XXH3_generateSecret_fromSeed
#include <xxhash.h>
#if defined(__x86_64__) && __has_include(<xxh_x86dispatch.h>)
// libxxhash's run-time dispatch: its AVX2 kernel where the CPU has one (about twice the
// SSE2 speed on data in cache; the same digests). It also maps the plain XXH3 names to it.
#include <xxh_x86dispatch.h>
#endif

#include <fmt/format.h>

#include "wsync/device_runtime.h"

namespace wsync {
namespace {

std::string ToHex(const unsigned char* data, size_t n) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = kHex[data[i] >> 4];
    out[2 * i + 1] = kHex[data[i] & 15];
  }
  return out;
}

class Sha256Hasher final : public Hasher {
 public:
  Sha256Hasher() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Sha256Hasher() override { EVP_MD_CTX_free(ctx_); }
  void Update(std::span<const std::byte> bytes) override {
    EVP_DigestUpdate(ctx_, bytes.data(), bytes.size());
  }
  std::string FinishHex() override {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx_, md, &len);
    return ToHex(md, len);
  }

 private:
  EVP_MD_CTX* ctx_;
};

class Xxh3Hasher final : public Hasher {
 public:
  Xxh3Hasher() : state_(XXH3_createState()) { XXH3_128bits_reset(state_); }
  ~Xxh3Hasher() override { XXH3_freeState(state_); }
  void Update(std::span<const std::byte> bytes) override {
    XXH3_128bits_update(state_, bytes.data(), bytes.size());
  }
  std::string FinishHex() override {
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(state_));
    return ToHex(canonical.digest, sizeof(canonical.digest));
  }

 private:
  XXH3_state_t* state_;
};

}  // namespace

Result<DigestAlgorithm> ParseDigestAlgorithm(std::string_view name) {
  if (name == "sha256") return DigestAlgorithm::kSha256;
  if (name == "xxh3_128" || name == "xxh3-128") return DigestAlgorithm::kXxh3_128;
  return InvalidArgument(fmt::format("unknown checksum algorithm '{}': use sha256 or xxh3_128", name));
}

std::string_view DigestAlgorithmName(DigestAlgorithm algorithm) {
  return algorithm == DigestAlgorithm::kSha256 ? "sha256" : "xxh3_128";
}

std::unique_ptr<Hasher> Hasher::Create(DigestAlgorithm algorithm) {
  if (algorithm == DigestAlgorithm::kSha256) return std::make_unique<Sha256Hasher>();
  return std::make_unique<Xxh3Hasher>();
}

std::string HexDigest(DigestAlgorithm algorithm, std::span<const std::byte> bytes) {
  auto h = Hasher::Create(algorithm);
  h->Update(bytes);
  return h->FinishHex();
}

bool IsLowerHex(std::string_view text) {
  return !text.empty() && std::ranges::all_of(text, [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

xxh3::Secret Xxh3DefaultSecret() {
  xxh3::Secret secret;
  static_assert(sizeof(secret.bytes) == XXH3_SECRET_DEFAULT_SIZE);
  XXH3_generateSecret_fromSeed(secret.bytes, 0);
  return secret;
}

xxh3::Hash128 Xxh3ByLanes(std::span<const std::byte> bytes) {
  static const xxh3::Secret secret = Xxh3DefaultSecret();
  auto load = [&](uint64_t at) {
    uint64_t v;
    std::memcpy(&v, bytes.data() + at, 8);
    return v;
  };
  auto byte = [&](uint64_t at) { return static_cast<unsigned char>(bytes[at]); };
  if (bytes.size() <= xxh3::kMidSizeMax) return xxh3::Short(load, byte, bytes.size(), secret);
  return xxh3::LongByLanes(load, bytes.size(), secret);
}

std::string Xxh3Hex(const xxh3::Hash128& digest) {
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, XXH128_hash_t{digest.low, digest.high});
  return ToHex(canonical.digest, sizeof(canonical.digest));
}

void CopyAndHash(std::byte* dst, std::span<const std::byte> src, Hasher& hasher, bool hash_destination) {
  for (size_t done = 0; done < src.size(); done += kCopyHashBlockBytes) {
    const size_t n = std::min(kCopyHashBlockBytes, src.size() - done);
    std::memcpy(dst + done, src.data() + done, n);
    hasher.Update(std::span<const std::byte>(hash_destination ? dst + done : src.data() + done, n));
  }
}

Result<std::string> TensorHexDigest(DigestAlgorithm algorithm, const TensorRef& tensor,
                                    std::vector<std::byte>& scratch) {
  if (tensor.device.is_cpu()) return HexDigest(algorithm, tensor.bytes);
  auto fail = [&](const Status& s) {
    return s.WithContext(fmt::format("reading tensor {} back from {} to digest it", tensor.name,
                                     tensor.device.ToString()));
  };
  if (Status s = UseDeviceOnThisThread(tensor.device); !s.ok()) return fail(s);
  auto hasher = Hasher::Create(algorithm);
  scratch.resize(std::min(tensor.bytes.size(), kDeviceReadBackBlockBytes));
  for (size_t done = 0; done < tensor.bytes.size();) {
    const size_t n = std::min(scratch.size(), tensor.bytes.size() - done);
    if (Status s = CopyAndWait(tensor.device, scratch.data(), n, tensor.bytes.data() + done, n, n, 1); !s.ok()) {
      return fail(s);
    }
    hasher->Update(std::span<const std::byte>(scratch.data(), n));
    done += n;
  }
  return hasher->FinishHex();
}

Result<std::vector<std::string>> DeviceXxh3Hex(const Device& device, std::span<const DeviceRuntime::Span> spans) {
  std::vector<std::string> hexes;
  if (spans.empty()) return hexes;
  WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device));
  WSYNC_RETURN_IF_ERROR(UseDeviceOnThisThread(device));
  std::vector<uint64_t> out(2 * spans.size());
  WSYNC_RETURN_IF_ERROR(rt->Xxh3Digests(spans, out));
  hexes.reserve(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) hexes.push_back(Xxh3Hex(xxh3::Hash128{out[2 * i], out[2 * i + 1]}));
  return hexes;
}

Status HostXxh3Digests(std::span<const DeviceRuntime::Span> spans, std::span<uint64_t> out) {
  if (out.size() != 2 * spans.size()) {
    return InvalidArgument(fmt::format("{} digest words for {} spans", out.size(), spans.size()));
  }
  for (size_t i = 0; i < spans.size(); ++i) {
    const xxh3::Hash128 h = Xxh3ByLanes({static_cast<const std::byte*>(spans[i].data), spans[i].bytes});
    out[2 * i] = h.low;
    out[2 * i + 1] = h.high;
  }
  return Status::Ok();
}

}  // namespace wsync
