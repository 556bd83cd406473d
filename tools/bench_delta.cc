// `wsync bench delta`: placeholder until the delta backend lands (issue 3).
#include <fmt/format.h>

#include "bench.h"

namespace wsync::cli {

int RunBenchDelta(const BenchArgs&) {
  fmt::print(stderr, "wsync bench delta: the delta backend is not built into this wsync yet\n");
  return 2;
}

}  // namespace wsync::cli
