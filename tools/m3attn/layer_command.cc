// `m3attn layer`: one mixed step of one attention layer (see src/layer/layer_runner.h), on the CPU
// or CUDA backend (default: cuda when this build has it and a device is present and --tp is 1).
// Prints a summary, or one JSON object with --json.
#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "layer/layer_runner.h"

namespace m3attn::cli {

namespace {

struct LayerFlags {
  int hidden = 0, q_heads = 0, kv_heads = 0;
  bool m3 = false, dense = false, unfused = false, json = false;
  std::string context = "384:1800";
  int gen = 4, draft = 1;
  int64_t context_len = 3000;
  uint64_t seed = 1;
  int tp = 1;
  std::string backend;  // empty: cuda when available (TP1), else cpu
  std::string weights, inputs, dump;
  int layer = 0;
  float rope_theta = 5e6f, eps = 1e-6f;
};

// Bad flags and bad files exit 2; a run that fails exits 1.
int layer_exit_code_for(const Status& s) {
  if (s.code() == StatusCode::kIoError || s.code() == StatusCode::kDataLoss) return 2;
  return exit_code_for(s);
}

}  // namespace

void add_layer_command(CLI::App& app, int& exit_code) {
  CLI::App* cmd = app.add_subcommand(
      "layer",
      "Run one mixed MSA layer step (context chunks, then generation requests with drafts) and "
      "report tokens per phase, blocks selected and time per stage. Without --context and --gen "
      "the step is --context 384:1800 --gen 4 --draft 1 --context-len 3000.");
  auto f = std::make_shared<LayerFlags>();
  auto* hidden = cmd->add_option("--hidden", f->hidden, "Hidden size (default 1024)")
                     ->check(CLI::PositiveNumber);
  auto* q_heads = cmd->add_option("--q-heads", f->q_heads, "Query heads (default 8)")
                      ->check(CLI::PositiveNumber);
  auto* kv_heads = cmd->add_option("--kv-heads", f->kv_heads, "KV heads (default 2)")
                       ->check(CLI::PositiveNumber);
  cmd->add_flag("--m3", f->m3, "Use the real MiniMax-M3 geometry (hidden 6144, 64 q / 4 kv heads)")
      ->excludes(hidden)
      ->excludes(q_heads)
      ->excludes(kv_heads);
  cmd->add_flag("--dense", f->dense, "Random weights of a dense layer (layers 0-2) instead of MSA");
  cmd->add_flag("--unfused", f->unfused,
                "Two GEMMs and two producers instead of the fused [Q|K|V|iQ|iK] projection");
  auto* context =
      cmd->add_option("--context", f->context,
                      "Context chunks TOKENS[:CACHED],... (CACHED tokens already in the cache)");
  auto* gen =
      cmd->add_option("--gen", f->gen, "Generation requests")->check(CLI::NonNegativeNumber);
  cmd->add_option("--draft", f->draft, "Draft tokens per generation request (each brings 1 + D)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--context-len", f->context_len, "Cached tokens of every generation request")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--seed", f->seed, "Seed of the random weights, inputs and cached prefixes");
  cmd->add_option("--tp", f->tp, "Simulated tensor-parallel size (1, 2, 4, 8): all ranks run")
      ->check(CLI::IsMember({1, 2, 4, 8}));
  cmd->add_option("--backend", f->backend,
                  "cpu or cuda (default: cuda when a GPU is present and --tp is 1, else cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--weights", f->weights,
                  "Safetensors file (or checkpoint directory) with model.layers.N.self_attn.* "
                  "tensors, BF16/F32 or FP8; geometry from the shapes");
  cmd->add_option("--layer", f->layer, "N of model.layers.N in --weights")
      ->check(CLI::NonNegativeNumber);
  auto* inputs = cmd->add_option(
      "--inputs", f->inputs,
      "Safetensors with input.hidden_states [T, hidden] (bf16/f32) and input.positions i32 [T] "
      "= 0..T-1: one sequence prefilled from position 0");
  inputs->excludes(context)->excludes(gen);
  cmd->add_option("--dump", f->dump,
                  "Write output.attn_out, output.attn_core, output.block_ids and inter.q/k/v/"
                  "index_q/index_k (E4M3) to this safetensors file");
  cmd->add_option("--rope-theta", f->rope_theta, "RoPE theta when the weights carry no config");
  cmd->add_option("--eps", f->eps, "RMSNorm eps when the weights carry no config");
  cmd->add_flag("--json", f->json, "Print one JSON object instead of the summary");

  cmd->callback([f, cmd, &exit_code]() {
    LayerRunOptions o;
    if (f->m3) {
      o.geometry = MsaGeometry::m3();
    } else {
      if (f->hidden) o.geometry.hidden = f->hidden;
      if (f->q_heads) o.geometry.n_q = f->q_heads;
      if (f->kv_heads) o.geometry.n_kv = f->kv_heads;
    }
    o.sparse = !f->dense;
    o.fused = !f->unfused;
    const bool step_given = cmd->count("--context") > 0 || cmd->count("--gen") > 0;
    if (f->inputs.empty()) {
      std::string context = f->context;
      int gen = f->gen;
      if (step_given) {
        if (cmd->count("--context") == 0) context.clear();
        if (cmd->count("--gen") == 0) gen = 0;
      }
      Result<std::vector<ContextSpec>> chunks = parse_context_list(context);
      if (!chunks.ok()) {
        std::cerr << "m3attn layer: " << chunks.status().to_string() << "\n";
        exit_code = 2;
        return;
      }
      o.context = chunks.value();
      o.gen = gen;
      o.draft = f->draft;
      o.gen_context_len = f->context_len;
    }
    o.seed = f->seed;
    o.tp_size = f->tp;
    std::string chosen = f->backend;
    if (chosen.empty()) chosen = (f->tp == 1 && cuda_backend_available()) ? "cuda" : "cpu";
    Result<Backend> backend = parse_backend(chosen);
    if (!backend.ok()) {
      std::cerr << "m3attn layer: " << backend.status().to_string() << "\n";
      exit_code = 2;
      return;
    }
    o.backend = backend.value();
    o.weights_path = f->weights;
    o.layer_index = f->layer;
    o.inputs_path = f->inputs;
    o.dump_path = f->dump;
    o.rope_theta = f->rope_theta;
    o.eps = f->eps;

    Result<LayerRunReport> rep = run_layer(o);
    if (!rep.ok()) {
      std::cerr << "m3attn layer: " << rep.status().to_string() << "\n";
      exit_code = layer_exit_code_for(rep.status());
      return;
    }
    if (f->json) {
      std::cout << rep.value().to_json() << "\n";
    } else {
      std::cout << rep.value().to_text();
      if (!f->dump.empty()) std::cout << "dump: " << f->dump << "\n";
    }
    exit_code = rep.value().out_finite ? 0 : 1;
  });
}

}  // namespace m3attn::cli
