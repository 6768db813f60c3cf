// `m3attn layer`: placeholder until the CPU layer lands (see issue: foundation).
#include <iostream>

#include "commands.h"

namespace m3attn::cli {

void add_layer_command(CLI::App& app, int& exit_code) {
  CLI::App* cmd = app.add_subcommand("layer", "Run one mixed MSA layer step");
  cmd->callback([&exit_code]() {
    std::cerr << "m3attn layer: not built yet\n";
    exit_code = 1;
  });
}

}  // namespace m3attn::cli
