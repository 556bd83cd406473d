// The `ipc` backend as the rest of wsync sees it: its name, init_info and update_info
// fields, options schema, factories and cost hook (src/backends/descriptor.h). Listed
// once, in src/backends/registry.cc.
#pragma once

#include "backends/descriptor.h"

namespace wsync {

const BackendDescriptor& IpcBackend();

}  // namespace wsync
