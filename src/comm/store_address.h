// Which rendezvous store a server may dial.
//
// The nccl backend's CPU path joins a Gloo group through the trainer's HTTP rendezvous
// store, whose host and port arrive in the init request (gloo_store_host/port). A server
// that dials whatever a request names can be made to send requests anywhere its network
// reaches. The rule (the trust boundary, docs/security.md):
//
//   - the store must be on the host that sent the init request: one of the addresses
//     gloo_store_host resolves to must be the HTTP peer's own address;
//   - a loopback peer may name any loopback address (127.0.0.0/8, ::1, localhost);
//   - any other host must be admitted by the server's own flags (`wsync serve
//     --allow-store-host HOST`, repeatable; "*" admits every host and gives the rule up).
//
// The server then dials the numeric address that was admitted, never the name again, so
// a name that resolves differently a moment later changes nothing. Thread-safe; a host
// name (not a numeric address) is resolved with getaddrinfo, which may block for the
// resolver's own timeout.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "wsync/status.h"

namespace wsync {

// The numeric address (IPv4 dotted quad or IPv6 text) to dial for `host`, asked for by the
// peer at `peer_address` ("10.0.0.7", "::1", "::ffff:10.0.0.7"; empty when unknown: then
// only `allowed_hosts` admit). InvalidArgument naming the host, the peer and the flag
// when the host is not admitted or does not resolve.
Result<std::string> AdmitStoreHost(std::string_view host, std::string_view peer_address,
                                   const std::vector<std::string>& allowed_hosts);

// True when `address` is a numeric loopback address (127.0.0.0/8, ::1, ::ffff:127.x.y.z).
bool IsLoopbackAddress(std::string_view address);

}  // namespace wsync
