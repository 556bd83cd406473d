#include "comm/communicator.h"

#include <fmt/format.h>

namespace wsync {

std::string DescribeRankOrDefault(const DescribeRank& describe, int rank) {
  return describe ? describe(rank) : fmt::format("rank {}", rank);
}

}  // namespace wsync
