#include "core/log.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

#include <spdlog/sinks/stdout_color_sinks.h>

#include "core/env_knobs.h"

namespace wsync::log {

void Init(std::string_view role) {
  spdlog::drop("wsync");  // a second Init replaces the first
  auto logger = spdlog::stderr_color_mt("wsync");
  logger->set_pattern(fmt::format("[%H:%M:%S.%e] [%^%l%$] [{} pid {}] %v", role, getpid()));
  const char* level = WSYNC_ENV("WSYNC_LOG_LEVEL");
  logger->set_level(level ? spdlog::level::from_str(level) : spdlog::level::info);
  spdlog::set_default_logger(logger);
}

}  // namespace wsync::log
