// One logger for the process. Lines carry the process role (serve, push, demo), and
// callers add rank and device where they have them. Level from WSYNC_LOG_LEVEL
// (trace, debug, info, warn, error, off; default info). Thread-safe.
#pragma once

#include <string_view>

#include <spdlog/spdlog.h>

namespace wsync::log {

// Installs the stderr logger with `role` in every line, at WSYNC_LOG_LEVEL. Call once
// from main() (or a Python extension's init); a later call replaces the logger.
void Init(std::string_view role);

}  // namespace wsync::log

#define WSYNC_LOG_TRACE(...) SPDLOG_TRACE(__VA_ARGS__)
#define WSYNC_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define WSYNC_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define WSYNC_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define WSYNC_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
