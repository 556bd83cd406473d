// One rank of a multi-process Gloo group, for gloo_communicator_test.
//
//   gloo_rank_helper <store_port> <prefix> <rank> <size> <bytes> [p2p]
//
// Joins the group, then for root = 0 .. size-1 broadcasts <bytes> bytes from root: the
// root fills pattern root+1, every other rank checks it bit for bit. With `p2p`, it
// instead sends <bytes> bytes of pattern 7 to rank 0 with tag 1, then sleeps until it is
// killed (the test's dead peer). Exit 0 when all broadcasts matched, 1 on a communicator
// error, 2 on a mismatch, 3 on bad arguments.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "comm/gloo_communicator.h"
#include "comm/testing.h"

int main(int argc, char** argv) {
  const bool p2p = argc == 7 && std::string(argv[6]) == "p2p";
  if (argc != 6 && !p2p) {
    std::fprintf(stderr, "usage: %s <store_port> <prefix> <rank> <size> <bytes> [p2p]\n", argv[0]);
    return 3;
  }
  wsync::GlooOptions o;
  o.store_port = std::atoi(argv[1]);
  o.prefix = argv[2];
  o.rank = std::atoi(argv[3]);
  o.size = std::atoi(argv[4]);
  size_t bytes = std::strtoull(argv[5], nullptr, 10);
  o.connect_deadline = wsync::Deadline::InSeconds(30);
  o.op_timeout = std::chrono::seconds(30);

  auto comm = wsync::ConnectGloo(o);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", o.rank, comm.status().ToString().c_str());
    return 1;
  }
  std::vector<std::byte> buf(bytes);
  if (p2p) {
    wsync::testing::FillPattern(buf, 7);
    const wsync::Communicator::PeerMessage send{0, 1, buf};
    wsync::Status s = (*comm)->ExchangePeers({&send, 1}, {}, wsync::Deadline::InSeconds(60));
    if (!s.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", o.rank, s.ToString().c_str());
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  for (int root = 0; root < o.size; ++root) {
    if (root == o.rank) wsync::testing::FillPattern(buf, root + 1);
    wsync::Status s = (*comm)->Broadcast(buf, root, wsync::Deadline::InSeconds(60));
    if (!s.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", o.rank, s.ToString().c_str());
      return 1;
    }
    int64_t bad = wsync::testing::FirstMismatch(buf, root + 1);
    if (bad >= 0) {
      std::fprintf(stderr, "rank %d: broadcast from %d differs at byte %lld\n", o.rank, root,
                   static_cast<long long>(bad));
      return 2;
    }
  }
  return 0;
}
