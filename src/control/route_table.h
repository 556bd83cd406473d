// The route table HttpRouter answers (http_routes.cc), as data, for a front that is not
// the router itself: a Python front reads it through the binding (`_wsync.http_routes()`)
// instead of spelling the routes again. Each entry is one route's method, path, lane
// (HttpLane, by name) and the top-level body fields the route reads.
#pragma once

#include <string_view>
#include <vector>

namespace wsync {

struct RouteEntry {
  std::string_view method;  // "GET" or "POST"
  std::string_view path;    // as control/routes.h spells it
  // "read", "control" or "generation" (HttpRouter::LaneOf; /pause and /sleep with
  // mode=wait run on "generation", otherwise on "control").
  std::string_view lane;
  std::vector<std::string_view> fields;  // the body fields the route reads
  bool all_fields = false;               // the route reads the whole body
};

// Every route, in the router's order.
std::vector<RouteEntry> RouteTable();

}  // namespace wsync
