// CheckpointDir and the WeightSource over it (declared in safetensors.h).
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/json_limits.h"
#include "core/syscall.h"
#include "format/safetensors.h"

namespace wsync {
namespace {

constexpr std::string_view kIndexFile = "model.safetensors.index.json";

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// File names (not paths) of every regular *.safetensors file in `dir`, sorted.
Result<std::vector<std::string>> ListSafetensors(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    int err = errno;
    return ErrnoStatus(err, fmt::format("opening checkpoint directory {}", dir),
                       err == ENOENT ? StatusCode::kNotFound : StatusCode::kInvalidArgument);
  }
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.ends_with(".safetensors") && IsRegularFile(dir + "/" + name)) names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  if (names.empty()) return NotFound(fmt::format("no *.safetensors files in {}", dir));
  return names;
}

// The weight_map of an index file: tensor name -> file name.
Result<std::map<std::string, std::string>> ReadWeightMap(const std::string& path) {
  std::ifstream in(path);
  if (!in) return ErrnoStatus(errno, fmt::format("reading {}", path), StatusCode::kInternal);
  std::stringstream text;
  text << in.rdbuf();
  Result<nlohmann::json> parsed = ParseUntrustedJson(text.str(), path);
  if (!parsed.ok()) return parsed.status();
  const nlohmann::json& index = *parsed;
  if (!index.is_object()) return InvalidArgument(fmt::format("{} is not a JSON object", path));
  auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object()) {
    return InvalidArgument(fmt::format("{} has no \"weight_map\" object", path));
  }
  std::map<std::string, std::string> out;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it->is_string()) {
      return InvalidArgument(fmt::format("{}: weight_map entry of {} is not a file name", path,
                                                     TextExcerpt(it.key(), kMaxNameBytes)));
    }
    std::string file = it->get<std::string>();
    // The map names files inside the directory; refuse anything that leaves it.
    if (file.empty() || file.front() == '/' || file == ".." || file.starts_with("../") ||
        file.find("/../") != std::string::npos || file.ends_with("/..")) {
      return InvalidArgument(fmt::format("{}: weight_map maps {} to '{}', outside the directory", path,
                                         TextExcerpt(it.key(), kMaxNameBytes), TextExcerpt(file, kMaxNameBytes)));
    }
    out.emplace(it.key(), std::move(file));
  }
  return out;
}

class CheckpointStream final : public TensorStream {
 public:
  CheckpointStream(const CheckpointDir& ckpt, const std::vector<TensorMeta>& order)
      : ckpt_(ckpt), order_(order) {}
  Result<bool> Next(TensorRef* out) override {
    if (next_ >= order_.size()) return false;
    WSYNC_ASSIGN_OR_RETURN(*out, ckpt_.Ref(order_[next_++].name));
    return true;
  }

 private:
  const CheckpointDir& ckpt_;
  const std::vector<TensorMeta>& order_;
  size_t next_ = 0;
};

class CheckpointSource final : public WeightSource {
 public:
  CheckpointSource(CheckpointDir ckpt, std::vector<TensorMeta> metadata)
      : ckpt_(std::move(ckpt)), metadata_(std::move(metadata)) {}
  const std::vector<TensorMeta>& metadata() const override { return metadata_; }
  Result<std::unique_ptr<TensorStream>> Iterate() override {
    return std::unique_ptr<TensorStream>(std::make_unique<CheckpointStream>(ckpt_, metadata_));
  }
  // Views of the files' mappings, which live as long as the source.
  bool StableRefs() const override { return true; }

 private:
  CheckpointDir ckpt_;
  std::vector<TensorMeta> metadata_;
};

}  // namespace

Result<CheckpointDir> CheckpointDir::Open(const std::string& dir) {
  CheckpointDir c;
  c.dir_ = dir;
  const std::string index_path = dir + "/" + std::string(kIndexFile);
  std::optional<std::map<std::string, std::string>> weight_map;
  std::vector<std::string> names;
  if (IsRegularFile(index_path)) {
    WSYNC_ASSIGN_OR_RETURN(weight_map, ReadWeightMap(index_path));
    std::set<std::string> files;
    for (const auto& [tensor, file] : *weight_map) files.insert(file);
    names.assign(files.begin(), files.end());
    if (names.empty()) return InvalidArgument(fmt::format("{} has an empty weight_map", index_path));
  } else {
    WSYNC_ASSIGN_OR_RETURN(names, ListSafetensors(dir));
  }

  c.files_.reserve(names.size());
  for (const std::string& name : names) {
    WSYNC_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open(dir + "/" + name));
    c.files_.push_back(std::move(f));
  }
  for (size_t fi = 0; fi < c.files_.size(); ++fi) {
    const SafetensorsFile& f = c.files_[fi];
    for (size_t ti = 0; ti < f.tensors().size(); ++ti) {
      const TensorMeta& m = f.tensors()[ti];
      auto [it, inserted] = c.where_.emplace(m.name, Location{fi, ti});
      if (!inserted) {
        return InvalidArgument(fmt::format("tensor {} is in both {} and {}", m.name,
                                           c.files_[it->second.file].path(), f.path()));
      }
      c.tensors_.push_back(m);
    }
  }
  if (weight_map) {
    for (const auto& [tensor, file] : *weight_map) {
      auto it = c.where_.find(tensor);
      const std::string path = dir + "/" + file;
      if (it == c.where_.end()) {
        return DataLoss(fmt::format("{} maps {} to {}, which has no such tensor", index_path, tensor, path));
      }
      if (c.files_[it->second.file].path() != path) {
        return DataLoss(fmt::format("{} maps {} to {}, but it is in {}", index_path, tensor, path,
                                    c.files_[it->second.file].path()));
      }
    }
  }
  return c;
}

Result<std::span<const std::byte>> CheckpointDir::Bytes(std::string_view name) const {
  auto it = where_.find(name);
  if (it == where_.end()) return NotFound(fmt::format("checkpoint {} has no tensor {}", dir_, name));
  return files_[it->second.file].BytesAt(it->second.tensor);
}

Result<TensorRef> CheckpointDir::Ref(std::string_view name) const {
  auto it = where_.find(name);
  if (it == where_.end()) return NotFound(fmt::format("checkpoint {} has no tensor {}", dir_, name));
  return files_[it->second.file].RefAt(it->second.tensor);
}

Result<const SafetensorsFile*> CheckpointDir::FileOf(std::string_view name) const {
  auto it = where_.find(name);
  if (it == where_.end()) return NotFound(fmt::format("checkpoint {} has no tensor {}", dir_, name));
  return &files_[it->second.file];
}

Result<std::unique_ptr<WeightSource>> OpenCheckpointSource(const std::string& dir,
                                                           std::optional<std::vector<std::string>> order) {
  WSYNC_ASSIGN_OR_RETURN(CheckpointDir ckpt, CheckpointDir::Open(dir));
  std::vector<TensorMeta> metadata;
  if (!order) {
    metadata = ckpt.tensors();
  } else {
    std::set<std::string_view> seen;
    metadata.reserve(order->size());
    for (const std::string& name : *order) {
      if (!seen.insert(name).second) {
        return InvalidArgument(fmt::format("order for checkpoint {} lists {} twice", dir, name));
      }
      WSYNC_ASSIGN_OR_RETURN(TensorRef ref, ckpt.Ref(name));
      metadata.push_back(TensorMeta{name, ref.dtype, Shape(ref.shape.begin(), ref.shape.end())});
    }
    for (const TensorMeta& m : ckpt.tensors()) {
      if (!seen.contains(m.name)) {
        return InvalidArgument(fmt::format("order for checkpoint {} leaves out tensor {} ({} of {} listed)",
                                           dir, m.name, order->size(), ckpt.tensors().size()));
      }
    }
  }
  return std::unique_ptr<WeightSource>(std::make_unique<CheckpointSource>(std::move(ckpt), std::move(metadata)));
}

}  // namespace wsync
