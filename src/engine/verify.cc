#include "engine/verify.h"

#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "control/session_driver.h"
#include "core/parallel.h"
#include "quant/fp8_block.h"
#include "quant/fp8_digest.h"
#include "quant/fp8_sharding.h"

namespace wsync {

using nlohmann::json;

namespace {

// fn(ref, scratch) -> Result<T> for every tensor, in parallel, one scratch per thread;
// the first failure in tensor order is returned.
template <typename T, typename Fn>
Result<std::vector<T>> DigestAll(const std::vector<TensorRef>& refs, const std::vector<size_t>& which, Fn fn) {
  std::vector<T> out(refs.size());
  std::vector<Status> failed(refs.size());
  ParallelFor(which.size(), DefaultThreads(), [&](size_t b, size_t e) {
    std::vector<std::byte> scratch;
    for (size_t k = b; k < e; ++k) {
      const size_t i = which[k];
      Result<T> d = fn(refs[i], scratch);
      if (d.ok()) {
        out[i] = *std::move(d);
      } else {
        failed[i] = d.status();
      }
    }
  });
  for (Status& s : failed) WSYNC_RETURN_IF_ERROR(s);
  return out;
}

// Whether a server's checksums follow the FP8 checkpoint convention for the trainer's
// (unquantized, 2-D) tensor `m`.
bool HoldsFp8(const json& sums, const TensorMeta& m) {
  return m.shape.size() == 2 && IsFp8QuantizableDType(m.dtype) && IsFp8Quantized(m.name) &&
         sums.contains(Fp8ScaleInvName(m.name));
}

}  // namespace

Status VerifyServers(const TrainerOptions& trainer, WeightSource& source, DigestAlgorithm alg) {
  SessionDriver driver(trainer.servers, trainer.api_key, trainer.timeout_seconds);
  // wsync servers answer /weight_checker by HF name; vLLM servers running wsync's plugin
  // answer the same through a collective RPC to their workers. One fan-out per kind, in
  // flight while the trainer digests.
  WSYNC_ASSIGN_OR_RETURN(Fleet fleet, driver.Discover());
  std::vector<std::string> plain_urls, vllm_urls;
  std::vector<bool> is_vllm(trainer.servers.size(), false);
  for (size_t i = 0; i < trainer.servers.size(); ++i) {
    is_vllm[i] = i < fleet.health.size() && fleet.health[i].is_object() &&
                 fleet.health[i].value("frontend", json()) == "vllm";
    (is_vllm[i] ? vllm_urls : plain_urls).push_back(trainer.servers[i]);
  }
  std::optional<SessionDriver> plain, vllm;
  std::shared_ptr<SessionDriver::Pending> pending, pending_vllm;
  if (!plain_urls.empty()) {
    plain.emplace(plain_urls, trainer.api_key, trainer.timeout_seconds);
    pending = plain->ChecksumsAsync(DigestAlgorithmName(alg), trainer.lora ? trainer.lora->name : std::string());
  }
  if (!vllm_urls.empty()) {
    vllm.emplace(vllm_urls, trainer.api_key, trainer.timeout_seconds);
    pending_vllm = vllm->WorkerChecksumsAsync(DigestAlgorithmName(alg), trainer.lora ? trainer.lora->name : std::string());
  }
  // The trainer's digests, computed while the servers compute theirs.
  const auto& meta = source.metadata();
  std::vector<TensorRef> refs;
  WSYNC_ASSIGN_OR_RETURN(auto stream, source.Iterate());
  TensorRef t;
  for (;;) {
    WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
    if (!more) break;
    refs.push_back(t);
  }
  if (refs.size() != meta.size()) return Internal("source iteration changed length");
  std::vector<size_t> every(refs.size());
  for (size_t i = 0; i < every.size(); ++i) every[i] = i;
  // Tensors on a GPU are read back in bounded blocks, one scratch per thread.
  WSYNC_ASSIGN_OR_RETURN(std::vector<std::string> mine,
                         DigestAll<std::string>(refs, every, [&](const TensorRef& r, std::vector<std::byte>& scratch) {
                           return TensorHexDigest(alg, r, scratch);
                         }));
  std::vector<json> plain_replies, vllm_replies;
  if (pending) {
    WSYNC_ASSIGN_OR_RETURN(plain_replies, pending->Wait(Deadline::InSeconds(trainer.timeout_seconds)));
  }
  if (pending_vllm) {
    WSYNC_ASSIGN_OR_RETURN(vllm_replies, pending_vllm->Wait(Deadline::InSeconds(trainer.timeout_seconds)));
  }
  std::vector<json> replies;
  for (size_t i = 0, p = 0, v = 0; i < trainer.servers.size(); ++i) {
    if (!is_vllm[i]) {
      replies.push_back(p < plain_replies.size() ? plain_replies[p++] : json::object());
      continue;
    }
    WSYNC_ASSIGN_OR_RETURN(json merged, MergeWorkerChecksums(v < vllm_replies.size() ? vllm_replies[v++] : json(),
                                                             trainer.servers[i]));
    replies.push_back(std::move(merged));
  }
  // Servers holding FP8 weights (serve --quantization fp8) report a quantized tensor as
  // NAME (e4m3 bytes) and NAME_scale_inv: the trainer quantizes its own tensor to match.
  std::vector<size_t> quantized;
  for (size_t i = 0; i < meta.size(); ++i) {
    if (std::ranges::any_of(replies, [&](const json& r) { return HoldsFp8(r["checksums"], meta[i]); })) {
      quantized.push_back(i);
    }
  }
  std::vector<Fp8Digests> fp8;
  if (!quantized.empty()) {
    WSYNC_ASSIGN_OR_RETURN(fp8, DigestAll<Fp8Digests>(refs, quantized,
                                                      [&](const TensorRef& r, std::vector<std::byte>& scratch) {
                                                        return Fp8TensorDigests(alg, r, scratch);
                                                      }));
  }
  for (size_t s = 0; s < replies.size(); ++s) {
    const json& sums = replies[s]["checksums"];
    // Tensors the server checks and drops (an MTP layer's on a server without a drafter).
    std::set<std::string> not_held;
    if (auto it = replies[s].find("not_held"); it != replies[s].end() && it->is_array()) {
      for (const json& n : *it) {
        if (n.is_string()) not_held.insert(n.get<std::string>());
      }
    }
    std::vector<std::string> bad;
    auto expect = [&](const std::string& name, const std::string& want) {
      if (not_held.contains(name)) return;
      auto it = sums.find(name);
      if (it == sums.end()) {
        bad.push_back(name + " (missing)");
      } else if (*it != want) {
        bad.push_back(name);
      }
    };
    for (size_t i = 0; i < meta.size(); ++i) {
      if (HoldsFp8(sums, meta[i])) {
        expect(meta[i].name, fp8[i].weight);
        expect(Fp8ScaleInvName(meta[i].name), fp8[i].scale_inv);
      } else {
        expect(meta[i].name, mine[i]);
      }
    }
    if (!bad.empty()) {
      return DataLoss(fmt::format("{}: {} of {} tensors differ from the trainer's ({}): {}{}",
                                  trainer.servers[s], bad.size(), meta.size(),
                                  DigestAlgorithmName(alg),
                                  fmt::join(bad.begin(), bad.begin() + std::min<size_t>(bad.size(), 5), ", "),
                                  bad.size() > 5 ? ", ..." : ""));
    }
  }
  return Status::Ok();
}

}  // namespace wsync
