// `m3attn bench`: the serving benchmark (src/engine/bench.h): a continuous-batching run of the
// attention layers of an M3-shaped model, fused and unfused over the same requests, one table with
// the fused/unfused ratio (or one JSON object with --json). Progress goes to stderr: a bar when
// stderr is a terminal, else one line every ~10 % of the requests.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "engine/bench.h"
#include "layer/layer_runner.h"

namespace m3attn::cli {

namespace {

struct BenchFlags {
  int64_t input_len = 0, output_len = 0, max_tokens = 0, pages = 0;
  int concurrency = 0, requests = 0, sparse = 0, dense = 3, draft = 0;
  uint64_t seed = 1;
  std::string backend, geometry;
  bool json = false, fused_only = false, unfused_only = false, no_warmup = false, verify = false,
       eager_mixed = false, pdl = false, no_attention_quantize = false;
};

// Renders progress on stderr: a redrawn bar on a terminal, sparse lines otherwise.
class Progress {
 public:
  explicit Progress(bool tty) : tty_(tty) {}
  void update(const BenchProgress& p) {
    const auto now = std::chrono::steady_clock::now();
    const std::string label =
        std::string(p.warmup ? "warm-up " : "") + (p.fused ? "fused" : "unfused");
    const bool run_done = p.finished == p.total;
    if (tty_) {
      if (!run_done && now - last_ < std::chrono::milliseconds(100)) return;
      last_ = now;
      const int width = 30;
      const int fill = p.total ? p.finished * width / p.total : width;
      std::fprintf(stderr, "\r[%d/%d %-15s] [%s%s] %d/%d requests, %lld steps, %.3f s simulated   ",
                   p.run + 1, p.runs, label.c_str(), std::string(fill, '#').c_str(),
                   std::string(width - fill, '.').c_str(), p.finished, p.total,
                   static_cast<long long>(p.steps), p.sim_us * 1e-6);
      if (run_done) std::fprintf(stderr, "\n");
      std::fflush(stderr);
      return;
    }
    const int decile = p.total ? p.finished * 10 / p.total : 10;
    if (p.warmup && !run_done) return;
    if (decile == last_decile_ && !run_done) return;
    if (run_done && decile == last_decile_ && p.warmup == last_warmup_) return;
    last_decile_ = run_done ? -1 : decile;
    last_warmup_ = p.warmup;
    std::fprintf(stderr,
                 "m3attn bench: run %d/%d %s: %d/%d requests, %lld steps, %.3f s simulated\n",
                 p.run + 1, p.runs, label.c_str(), p.finished, p.total,
                 static_cast<long long>(p.steps), p.sim_us * 1e-6);
    std::fflush(stderr);
  }

 private:
  bool tty_;
  std::chrono::steady_clock::time_point last_{};
  int last_decile_ = -1;
  bool last_warmup_ = false;
};

}  // namespace

void add_bench_command(CLI::App& app, int& exit_code) {
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "Serving benchmark of the attention layers (3 dense + N MSA) under continuous batching with "
      "chunked prefill: the same requests with the fused and the unfused projection, per-phase "
      "step time, TTFT, TPOT and tokens/s, and the fused/unfused ratio. Attention only: synthetic "
      "inputs, no sampler (every generation step counts 1 + draft tokens). Defaults: on cuda "
      "(m3 geometry) --input-len 8192 --output-len 256 --concurrency 64 --requests 128 --layers 8 "
      "--max-tokens-per-step 8192; on cpu (small geometry: hidden 1024, 8 q / 2 kv heads) "
      "--input-len 64 --output-len 8 --concurrency 2 --requests 4 --layers 1 "
      "--max-tokens-per-step 48 (about 10 s of CPU time).");
  auto f = std::make_shared<BenchFlags>();
  cmd->add_option("--input-len", f->input_len, "Prompt tokens per request")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--output-len", f->output_len, "Generated tokens per request")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--concurrency", f->concurrency, "Requests in flight at most")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--requests", f->requests, "Requests in the run")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  auto* layers = cmd->add_option("--layers", f->sparse, "MSA (sparse) layers after the dense ones")
                     ->check(CLI::Range(0, 256));
  cmd->add_option("--dense-layers", f->dense, "Dense causal layers first (default 3)")
      ->check(CLI::Range(0, 256));
  cmd->add_option("--max-tokens-per-step", f->max_tokens,
                  "Token budget of a step (generation first, then prompt chunks)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--draft", f->draft, "Draft tokens per generation step (all accepted)")
      ->check(CLI::Range(0, 64));
  cmd->add_option("--seed", f->seed, "Seed of the random weights and synthetic inputs");
  cmd->add_option("--backend", f->backend,
                  "cpu or cuda (default cuda when built with CUDA and a device is present)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--geometry", f->geometry,
                  "m3 (hidden 6144, 64 q / 4 kv heads) or small (hidden 1024, 8 q / 2 kv heads); "
                  "default m3 on cuda, small on cpu")
      ->check(CLI::IsMember({"m3", "small"}));
  cmd->add_option("--pages", f->pages, "KV pool pages (default concurrency x pages per request)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  auto* fused_only = cmd->add_flag("--fused-only", f->fused_only, "Run the fused variant only");
  auto* unfused_only =
      cmd->add_flag("--unfused-only", f->unfused_only, "Run the unfused variant only");
  fused_only->excludes(unfused_only);
  cmd->add_flag("--no-warmup", f->no_warmup,
                "Skip the unmeasured warm-up before each run (on by default on cuda)");
  cmd->add_flag("--verify", f->verify,
                "Hash the hidden states of every step (fused vs unfused identity over the whole "
                "run; default on cpu)");
  cmd->add_flag("--eager-mixed", f->eager_mixed,
                "cuda: run prefill / mixed steps fully eagerly (default: each layer's projection + "
                "producer replayed as a graph captured at the step's token count)");
  cmd->add_flag("--pdl", f->pdl,
                "cuda: programmatic dependent launch of the layers' stage kernels (same results)");
  cmd->add_flag("--no-attention-quantize", f->no_attention_quantize,
                "cuda: a separate kernel quantizes o_proj's input instead of the attention "
                "(same results)");
  cmd->add_flag("--json", f->json, "Print one JSON object instead of the table");

  cmd->callback([f, layers, &exit_code]() {
    BenchOptions o;
    o.backend = f->backend.empty() ? (cuda_backend_available() ? "cuda" : "cpu") : f->backend;
    const bool cuda = o.backend == "cuda";
    const std::string geometry = f->geometry.empty() ? (cuda ? "m3" : "small") : f->geometry;
    o.geometry = geometry == "m3" ? MsaGeometry::m3() : default_layer_geometry();
    Workload& w = o.workload;
    w.input_len = f->input_len ? f->input_len : (cuda ? 8192 : 64);
    w.output_len = f->output_len ? f->output_len : (cuda ? 256 : 8);
    w.concurrency = f->concurrency ? f->concurrency : (cuda ? 64 : 2);
    w.num_requests = f->requests ? f->requests : (cuda ? 128 : 4);
    w.draft_len = f->draft;
    w.seed = f->seed;
    o.num_sparse = layers->count() ? f->sparse : (cuda ? 8 : 1);
    o.num_dense = f->dense;
    o.max_tokens_per_step = f->max_tokens ? f->max_tokens : (cuda ? 8192 : 48);
    o.num_pages = f->pages;
    o.run_fused = !f->unfused_only;
    o.run_unfused = !f->fused_only;
    o.warmup = cuda && !f->no_warmup;
    o.capture_mixed_front = !f->eager_mixed;
    o.programmatic_launch = f->pdl;
    o.attention_quantize = !f->no_attention_quantize;
    o.digest_every_step = f->verify || !cuda;

    Progress progress(isatty(STDERR_FILENO) != 0);
    Result<BenchReport> rep =
        run_bench(o, [&progress](const BenchProgress& p) { progress.update(p); });
    if (!rep.ok()) {
      std::cerr << "m3attn bench: " << rep.status().to_string() << "\n";
      exit_code = exit_code_for(rep.status());
      return;
    }
    if (f->json) {
      std::cout << rep.value().to_json() << "\n";
    } else {
      std::cout << rep.value().to_text();
    }
    bool finite = true;
    for (const BenchRun& r : rep.value().runs) finite &= r.finite;
    // On the CPU the two paths are bit-identical by construction: a difference is a failure.
    const bool mismatch = rep.value().compared && rep.value().backend == std::string("cpu") &&
                          !rep.value().digests_equal;
    exit_code = finite && !mismatch ? 0 : 1;
  });
}

}  // namespace m3attn::cli
