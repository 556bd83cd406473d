#pragma once

#include <cstdint>
#include <string>

namespace wsync::cli {

struct DemoArgs {
  std::string model = "qwen3-0.6b";
  int servers = 2;
  int tp = 2;
  int steps = 3;
  uint64_t seed = 1;
  double timeout = 300;
};

int RunDemo(const DemoArgs& args);

}  // namespace wsync::cli
