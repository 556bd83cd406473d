// The weight-transfer backend an options struct (TrainerOptions, ReceiverEngineOptions,
// InferenceServerOptions) names when its caller names none. Which backends a build has,
// and what each takes, is the registry's: TrainerBackendNames(), `wsync serve --help`,
// Python's wsync.trainer_backends(). A constant; thread-safe.
#pragma once

namespace wsync {

inline constexpr char kDefaultBackend[] = "nccl";

}  // namespace wsync
