// Subcommands of the m3attn CLI. Each add_*_command registers its flags on `app` and sets the
// callback that runs it; the callback stores its exit code in `exit_code` (0 ok, 1 run failure,
// 2 bad flags or bad files).
#pragma once

#include <CLI/CLI.hpp>

#include "m3attn/status.h"

namespace m3attn::cli {

void add_info_command(CLI::App& app, int& exit_code);
void add_layer_command(CLI::App& app, int& exit_code);
void add_bench_command(CLI::App& app, int& exit_code);
void add_tp_command(CLI::App& app, int& exit_code);

// A failed run's exit code: 2 for bad flags (invalid, unsupported, out-of-range values), else 1.
// Commands that read files map their errors (kIoError, kDataLoss) to 2 before asking this.
inline int exit_code_for(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kUnsupported:
    case StatusCode::kOutOfRange:
      return 2;
    default:
      return 1;
  }
}

}  // namespace m3attn::cli
