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

// Whether a server holding FP8 weights holds the trainer's tensor `m` quantized.
bool Fp8Candidate(const TensorMeta& m) {
  return m.shape.size() == 2 && IsFp8QuantizableDType(m.dtype) && IsFp8Quantized(m.name);
}

// Whether a server's checksums follow the FP8 checkpoint convention for the trainer's
// (unquantized, 2-D) tensor `m`.
bool HoldsFp8(const json& sums, const TensorMeta& m) {
  return Fp8Candidate(m) && sums.contains(Fp8ScaleInvName(m.name));
}

// Whether TrainerDigests takes `t`'s digest on its device.
bool DigestsOnDevice(DigestAlgorithm algorithm, const TensorRef& t) {
  return algorithm == DigestAlgorithm::kXxh3_128 && !t.device.is_cpu();
}

// One tensor's digest as TrainerDigests takes it; `scratch` is TensorHexDigest's.
Result<std::string> TrainerDigest(DigestAlgorithm algorithm, const TensorRef& t, std::vector<std::byte>& scratch) {
  if (!DigestsOnDevice(algorithm, t)) return TensorHexDigest(algorithm, t, scratch);
  const DeviceRuntime::Span span{t.bytes.data(), t.bytes.size()};
  Result<std::vector<std::string>> hex = DeviceXxh3Hex(t.device, std::span(&span, 1));
  if (!hex.ok()) return hex.status().WithContext(fmt::format("digesting {} on {}", t.name, t.device.ToString()));
  return std::move(hex->front());
}

}  // namespace

Result<std::vector<std::string>> TrainerDigests(DigestAlgorithm algorithm, const std::vector<TensorRef>& tensors) {
  std::vector<std::string> out(tensors.size());
  std::vector<size_t> on_host;
  std::vector<std::pair<Device, std::vector<size_t>>> on_devices;  // xxh3 on a GPU, by device
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!DigestsOnDevice(algorithm, tensors[i])) {
      on_host.push_back(i);
      continue;
    }
    auto it = std::ranges::find_if(on_devices, [&](const auto& d) { return d.first == tensors[i].device; });
    if (it == on_devices.end()) it = on_devices.insert(on_devices.end(), {tensors[i].device, {}});
    it->second.push_back(i);
  }
  for (const auto& [device, which] : on_devices) {
    std::vector<DeviceRuntime::Span> spans;
    for (size_t i : which) spans.push_back({tensors[i].bytes.data(), tensors[i].bytes.size()});
    Result<std::vector<std::string>> hex = DeviceXxh3Hex(device, spans);
    if (!hex.ok()) {
      return hex.status().WithContext(fmt::format("digesting {} tensor(s) on {} ({}, ...)", which.size(),
                                                  device.ToString(), tensors[which.front()].name));
    }
    for (size_t k = 0; k < which.size(); ++k) out[which[k]] = std::move((*hex)[k]);
  }
  WSYNC_ASSIGN_OR_RETURN(std::vector<std::string> host,
                         DigestAll<std::string>(tensors, on_host, [&](const TensorRef& r, std::vector<std::byte>& scratch) {
                           return TensorHexDigest(algorithm, r, scratch);
                         }));
  for (size_t i : on_host) out[i] = std::move(host[i]);
  return out;
}

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
  // The trainer's digests, computed while the servers compute theirs. A yielded tensor
  // is valid only until the stream's next one (an all-gathered or cast temporary is freed
  // then), so each is digested before the next is read, with its FP8 digests when a
  // server may hold FP8; tensors inside the storage the source keeps for its life are
  // digested after the pass, on every thread.
  const auto& meta = source.metadata();
  const bool maybe_fp8 = std::ranges::any_of(fleet.health, [](const json& h) {
    return h.is_object() && h.value("quantization", json("none")) == "fp8";
  });
  const std::optional<SourceStorage> stable = source.storage();
  std::vector<TensorRef> refs(meta.size());  // the stable ones, for after the pass
  std::vector<size_t> later;
  std::vector<std::string> mine(meta.size());
  std::vector<Fp8Digests> fp8(meta.size());
  std::vector<bool> have_fp8(meta.size(), false);
  {
    WSYNC_ASSIGN_OR_RETURN(auto stream, source.Iterate());
    std::vector<std::byte> scratch;
    TensorRef t;
    size_t n = 0;
    for (;; ++n) {
      WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
      if (!more) break;
      if (n >= meta.size()) return Internal("source iteration changed length");
      if (stable && OffsetInStorage(*stable, t)) {
        refs[n] = t;
        later.push_back(n);
        continue;
      }
      WSYNC_ASSIGN_OR_RETURN(mine[n], TrainerDigest(alg, t, scratch));
      if (maybe_fp8 && Fp8Candidate(meta[n])) {
        WSYNC_ASSIGN_OR_RETURN(fp8[n], Fp8TensorDigests(alg, t, scratch));
        have_fp8[n] = true;
      }
    }
    if (n != meta.size()) return Internal("source iteration changed length");
  }
  {
    std::vector<TensorRef> kept;
    for (size_t i : later) kept.push_back(refs[i]);
    WSYNC_ASSIGN_OR_RETURN(std::vector<std::string> digests, TrainerDigests(alg, kept));
    for (size_t k = 0; k < later.size(); ++k) mine[later[k]] = std::move(digests[k]);
  }
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
  for (size_t i : later) {
    if (std::ranges::any_of(replies, [&](const json& r) { return HoldsFp8(r["checksums"], meta[i]); })) {
      quantized.push_back(i);
    }
  }
  if (!quantized.empty()) {
    WSYNC_ASSIGN_OR_RETURN(std::vector<Fp8Digests> after,
                           DigestAll<Fp8Digests>(refs, quantized,
                                                 [&](const TensorRef& r, std::vector<std::byte>& scratch) {
                                                   return Fp8TensorDigests(alg, r, scratch);
                                                 }));
    for (size_t i : quantized) {
      fp8[i] = std::move(after[i]);
      have_fp8[i] = true;
    }
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
        if (!have_fp8[i]) {
          bad.push_back(meta[i].name + " (held as FP8, but no server's /health said quantization fp8)");
          continue;
        }
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
