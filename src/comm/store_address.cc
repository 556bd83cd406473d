#include "comm/store_address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include <fmt/format.h>

namespace wsync {
namespace {

// An IP address in canonical form: IPv4-mapped IPv6 addresses become IPv4.
struct Ip {
  int family = AF_INET;
  std::array<unsigned char, 16> bytes{};
  bool operator==(const Ip&) const = default;
};

Ip Canonical(int family, const void* raw) {
  Ip ip;
  ip.family = family;
  if (family == AF_INET) {
    std::memcpy(ip.bytes.data(), raw, 4);
    return ip;
  }
  std::memcpy(ip.bytes.data(), raw, 16);
  static const unsigned char kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (std::memcmp(ip.bytes.data(), kMapped, 12) == 0) {
    Ip v4;
    v4.family = AF_INET;
    std::memcpy(v4.bytes.data(), ip.bytes.data() + 12, 4);
    return v4;
  }
  return ip;
}

std::optional<Ip> ParseNumeric(std::string_view text) {
  if (text.size() >= 2 && text.front() == '[' && text.back() == ']') text = text.substr(1, text.size() - 2);
  if (text.empty() || text.size() > 64) return std::nullopt;
  std::string s(text);
  unsigned char buf[16];
  if (inet_pton(AF_INET, s.c_str(), buf) == 1) return Canonical(AF_INET, buf);
  if (inet_pton(AF_INET6, s.c_str(), buf) == 1) return Canonical(AF_INET6, buf);
  return std::nullopt;
}

bool IsLoopback(const Ip& ip) {
  if (ip.family == AF_INET) return ip.bytes[0] == 127;
  static const unsigned char kV6Loopback[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  return std::memcmp(ip.bytes.data(), kV6Loopback, 16) == 0;
}

std::string Text(const Ip& ip) {
  char buf[INET6_ADDRSTRLEN] = {};
  inet_ntop(ip.family, ip.bytes.data(), buf, sizeof(buf));
  return buf;
}

// A host name as DNS allows it (letters, digits, '-', '.').
bool PlausibleHostName(std::string_view host) {
  if (host.empty() || host.size() > 253) return false;
  return std::all_of(host.begin(), host.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '.';
  });
}

std::vector<Ip> ResolveName(const std::string& name) {
  if (!PlausibleHostName(name)) return {};
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(name.c_str(), nullptr, &hints, &res) != 0) return {};
  std::vector<Ip> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      out.push_back(Canonical(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr));
    } else if (a->ai_family == AF_INET6) {
      out.push_back(Canonical(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr));
    }
  }
  freeaddrinfo(res);
  return out;
}

// The addresses of an --allow-store-host entry (never of a request's text): a literal
// address as it is, a name resolved once per process (a name that does not resolve admits
// nothing, and is not asked again).
std::vector<Ip> FlagAddresses(const std::string& entry) {
  if (auto ip = ParseNumeric(entry)) return {*ip};
  static std::mutex mu;
  static std::map<std::string, std::vector<Ip>>* resolved = new std::map<std::string, std::vector<Ip>>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = resolved->find(entry);
  if (it == resolved->end()) it = resolved->emplace(entry, ResolveName(entry)).first;
  return it->second;
}

// `text` cut for a message: it comes from a request body.
std::string Shown(std::string_view text) {
  std::string out;
  for (char c : text.substr(0, 80)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  return text.size() > 80 ? out + "..." : out;
}

}  // namespace

bool IsLoopbackAddress(std::string_view address) {
  auto ip = ParseNumeric(address);
  return ip && IsLoopback(*ip);
}

Result<std::string> AdmitStoreHost(std::string_view host, std::string_view peer_address,
                                   const std::vector<std::string>& allowed_hosts) {
  std::optional<Ip> addr = ParseNumeric(host);
  if (!addr) {
    return InvalidArgument(fmt::format(
        "init_info gloo_store_host '{}' is not a literal IPv4 or IPv6 address: a server never resolves a "
        "host name a request names; send the address of the trainer's store",
        Shown(host)));
  }
  std::optional<Ip> peer = ParseNumeric(peer_address);
  if (peer && (*addr == *peer || (IsLoopback(*peer) && IsLoopback(*addr)))) return Text(*addr);
  for (const std::string& entry : allowed_hosts) {
    if (entry == "*") return Text(*addr);
    for (const Ip& e : FlagAddresses(entry)) {
      if (e == *addr) return Text(*addr);
    }
  }
  return InvalidArgument(fmt::format(
      "init_info gloo_store_host '{}' is not the address of the host that sent this request ({}): a "
      "server dials only the rendezvous store of the trainer that initializes it; to admit another "
      "host, start the server with --allow-store-host {}",
      Shown(host), peer_address.empty() ? std::string("unknown") : Shown(peer_address), Shown(host)));
}

}  // namespace wsync
