// Broadcast trees: which rank a rank receives from and which ranks it forwards to.
//
// Pure functions of (rank, size, root), used by the Gloo broadcast and its tests. Ranks
// are renumbered so that the root is virtual rank 0; results are real ranks.
#pragma once

#include <vector>

namespace wsync {

struct BroadcastTree {
  int parent = -1;            // -1 on the root
  std::vector<int> children;  // in send order
};

// root -> root+1 -> root+2 -> ... (mod size).
inline BroadcastTree ChainTree(int rank, int size, int root) {
  BroadcastTree t;
  int v = (rank - root + size) % size;
  if (v > 0) t.parent = (v - 1 + root) % size;
  if (v + 1 < size) t.children.push_back((v + 1 + root) % size);
  return t;
}

// Gloo's binomial tree: virtual rank v receives from v with its highest set bit
// cleared and sends to v | 2^i for every 2^i above its highest bit.
inline BroadcastTree BinomialTree(int rank, int size, int root) {
  BroadcastTree t;
  int v = (rank - root + size) % size;
  int high = 0;  // 2^(bit length of v)
  while ((1 << high) <= v) ++high;
  if (v > 0) t.parent = ((v & ~(1 << (high - 1))) + root) % size;
  for (int i = high; (v | (1 << i)) < size; ++i)
    t.children.push_back(((v | (1 << i)) + root) % size);
  return t;
}

}  // namespace wsync
