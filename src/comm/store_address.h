// Which rendezvous store a server may dial.
//
// The nccl and sharded backends' CPU path joins a Gloo group through the trainer's HTTP
// rendezvous store, whose host and port arrive in the init request
// (gloo_store_host/port). A server that dials whatever a request names can be made to send
// requests anywhere its network reaches, and one that resolves a name a request chose
// makes DNS queries for whoever can reach its port. The rule (the trust boundary,
// docs/security.md):
//
//   - gloo_store_host is a literal IPv4 or IPv6 address ("10.0.0.7", "fd00::7", "[::1]"),
//     parsed with inet_pton; a host name is refused and never resolved;
//   - the store must be on the host that sent the init request: the address must be the
//     HTTP peer's own address;
//   - a loopback peer may name any loopback address (127.0.0.0/8, ::1);
//   - any other address must be admitted by the server's own flags (`wsync serve
//     --allow-store-host HOST`, repeatable; "*" admits every address and gives the rule
//     up). A flag entry may be a literal address or a host name; a name is resolved once
//     per process, the first time an init consults the list, and its addresses are kept.
//
// The server dials the numeric address that was admitted. Thread-safe; only the first
// consultation of a named flag entry may block, for the resolver's own timeout.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "wsync/status.h"

namespace wsync {

// The canonical text of the literal address `host` (IPv4 dotted quad or IPv6 text; an
// IPv4-mapped IPv6 address becomes IPv4), asked for by the peer at `peer_address`
// ("10.0.0.7", "::1", "::ffff:10.0.0.7"; empty when unknown: then only `allowed_hosts`
// admit). InvalidArgument naming the host when it is not a literal address, and the host,
// the peer and the flag when it is not admitted.
Result<std::string> AdmitStoreHost(std::string_view host, std::string_view peer_address,
                                   const std::vector<std::string>& allowed_hosts);

// True when `address` is a numeric loopback address (127.0.0.0/8, ::1, ::ffff:127.x.y.z).
bool IsLoopbackAddress(std::string_view address);

}  // namespace wsync
