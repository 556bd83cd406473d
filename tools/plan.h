#pragma once

#include <CLI/CLI.hpp>

namespace wsync::cli {

// Registers `wsync plan` (tools/plan.cc): parses its flags and, once parsed, runs the
// planner and exits with its status.
void AddPlanCommand(CLI::App& app);

}  // namespace wsync::cli
