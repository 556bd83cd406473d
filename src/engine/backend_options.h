// BackendOptions: reads a backend's own settings from TrainerOptions::backend_options.
//
// Each backend keeps its settings in an options struct of its own (NcclTrainerOptions,
// IpcTrainerOptions, DeltaTrainerOptions), which code may build directly and hand to the
// backend's CreateXTrainerWith; CreateTrainerEngine and `wsync push --backend-option
// KEY=VALUE` give them as text instead, and the backend's ParseXTrainerOptions reads them
// through this class: each Read names its key; Finish() refuses any key no Read asked
// for, listing the keys the backend knows. Errors name the backend, the key and the value.
// Each backend also declares its keys once as a schema (BackendOptionSpec, in its
// descriptor): CheckBackendOptionKeys refuses a key the schema lacks before any parse, and
// the CLI and Python read help and defaults from it. Not thread-safe (one parse at a time).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/status.h"

namespace wsync {

// One key of a backend's options (trainer side: TrainerOptions::backend_options; receiver
// side: ReceiverEngineOptions::backend_config).
struct BackendOptionSpec {
  std::string_view key;
  std::string_view type;           // "int", "float", "string", "path", "choice" or "list"
  std::string_view default_value;  // as text; empty: none (the backend decides)
  std::string_view help;           // one line; a choice lists its values here
  std::string_view flag;           // `wsync push`'s named flag for it ("--sync-dir"); empty: none
  bool hidden = false;             // tests' fault injection: accepted, left out of help texts
};

// OK when every key of `values` is in `schema`; else InvalidArgument naming the backend, the
// first unknown key and the keys the schema has: "backend 'B' has no option 'K' (its
// options: A, C)". The same text as BackendOptions::Finish.
Status CheckBackendOptionKeys(std::string_view backend, std::span<const BackendOptionSpec> schema,
                              const std::map<std::string, std::string>& values);
// The same for a list of keys (a receiver's backend_config object's).
Status CheckBackendOptionKeys(std::string_view backend, std::span<const BackendOptionSpec> schema,
                              const std::vector<std::string>& keys);

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
