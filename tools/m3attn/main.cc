// m3attn: MiniMax-M3 sparse attention (MSA) for Hopper GPUs, with a CPU backend.
#include <iostream>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"m3attn: MiniMax-M3 sparse attention on Hopper GPUs (and on the CPU)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "m3attn 0.1.0");
  int exit_code = 0;
  m3attn::cli::add_info_command(app, exit_code);
  m3attn::cli::add_layer_command(app, exit_code);
  m3attn::cli::add_bench_command(app, exit_code);
  m3attn::cli::add_tp_command(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // One line on stderr and exit code 2 for every bad command line.
    std::cerr << "m3attn: " << e.what() << " (run with --help for usage)\n";
    return 2;
  }
  return exit_code;
}
