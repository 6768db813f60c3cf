// Subcommands of the m3attn CLI. Each add_*_command registers its flags on `app` and sets the
// callback that runs it; the callback stores its exit code in `exit_code` (0 ok, 1 run failure,
// 2 bad flags or bad files).
#pragma once

#include <CLI/CLI.hpp>

namespace m3attn::cli {

void add_info_command(CLI::App& app, int& exit_code);
void add_layer_command(CLI::App& app, int& exit_code);
void add_bench_command(CLI::App& app, int& exit_code);
void add_tp_command(CLI::App& app, int& exit_code);

}  // namespace m3attn::cli
