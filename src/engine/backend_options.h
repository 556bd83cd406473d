// BackendOptions: reads a backend's own settings from TrainerOptions::backend_options.
//
// Each backend keeps its settings in an options struct of its own (NcclTrainerOptions,
// IpcTrainerOptions, DeltaTrainerOptions), which code may build directly and hand to the
// backend's CreateXTrainerWith; CreateTrainerEngine and `wsync push --backend-option
// KEY=VALUE` give them as text instead, and the backend's ParseXTrainerOptions reads them
// through this class: each Read names its key and its help; Finish() refuses any key no
// Read asked for, listing the keys the backend knows. Errors name the backend, the key
// and the value. Not thread-safe (one parse at a time).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/status.h"

namespace wsync {

class BackendOptions {
 public:
  BackendOptions(std::string_view backend, const std::map<std::string, std::string>& values);

  // Each leaves `*out` as it is when the key is absent.
  Status Read(std::string_view key, std::string* out);
  Status Read(std::string_view key, int64_t* out);
  Status Read(std::string_view key, size_t* out);
  Status Read(std::string_view key, double* out);
  // One of `choices` (the value's index in them).
  Status ReadChoice(std::string_view key, const std::vector<std::string_view>& choices, int* out);
  Status Finish() const;

 private:
  const std::string* Find(std::string_view key);
  std::string backend_;
  const std::map<std::string, std::string>& values_;
  std::vector<std::string> known_;
};

}  // namespace wsync
