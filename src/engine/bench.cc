#include "engine/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "cache/page_pool.h"
#include "core/numeric.h"

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace m3attn {

namespace {

constexpr uint64_t kFnvOffset = 1469598103934665603ull;

uint64_t fnv1a(uint64_t h, const void* data, int64_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (int64_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

std::string hex64(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

Status check_options(const BenchOptions& o) {
  M3_CHECK_ARG(o.backend == "cpu" || o.backend == "cuda", "unknown backend '", o.backend,
               "' (expected cpu or cuda)");
  M3_RETURN_IF_ERROR(o.geometry.validate());
  M3_CHECK_ARG(o.num_dense >= 0 && o.num_sparse >= 0 && o.num_dense + o.num_sparse >= 1,
               "the stack needs at least one layer, got ", o.num_dense, " dense and ", o.num_sparse,
               " sparse");
  M3_CHECK_ARG(o.num_dense + o.num_sparse <= 256, "at most 256 layers, got ",
               o.num_dense + o.num_sparse);
  M3_CHECK_ARG(o.run_fused || o.run_unfused, "nothing to run: both fused and unfused are off");
  M3_RETURN_IF_ERROR(o.workload.validate());
  return Status::Ok();
}

// The warm-up workload: full-concurrency batches of short requests.
Workload warmup_workload(const Workload& w) {
  Workload u = w;
  u.input_len = std::min<int64_t>(w.input_len, 256);
  u.output_len = std::min<int64_t>(w.output_len, 4);  // never more pages than a real request
  u.num_requests = w.concurrency;
  return u;
}

struct RunContext {
  LayerStack* stack = nullptr;
  const BenchProgressFn* progress = nullptr;
  BenchProgress state;
};

// Runs a whole workload on the stack. `run` receives digests and the final hidden states when set.
Status drive(const Workload& workload, const SchedulerOptions& so, RunContext& ctx,
             bool digest_every_step, Scheduler* out, BenchRun* run) {
  Result<Scheduler> sched = Scheduler::create(workload, so);
  M3_RETURN_IF_ERROR(sched.status());
  Scheduler& s = sched.value();
  uint64_t digest = kFnvOffset;
  const int hidden = ctx.stack->config().geometry.hidden;
  ctx.state.finished = 0;
  ctx.state.total = workload.num_requests;
  ctx.state.steps = 0;
  ctx.state.sim_us = 0;
  while (!s.done()) {
    Result<StepPlan> plan = s.next_step();
    M3_RETURN_IF_ERROR(plan.status());
    StackStepStats stats;
    M3_RETURN_IF_ERROR(ctx.stack->step(plan.value(), &stats));
    M3_RETURN_IF_ERROR(s.finish_step(plan.value(), stats.step_us));
    if (run) {
      run->graph_replays += stats.graph_replay ? 1 : 0;
      if (digest_every_step || s.done()) {
        Result<Tensor> h = ctx.stack->last_hidden();
        M3_RETURN_IF_ERROR(h.status());
        const Tensor& t = h.value();
        M3_CHECK_ARG(t.numel() == plan.value().num_tokens() * hidden, "last_hidden has ", t.numel(),
                     " values, expected ", plan.value().num_tokens(), " x ", hidden);
        digest = fnv1a(digest, t.data(), t.nbytes());
        const uint16_t* p = t.ptr<uint16_t>();
        double ss = 0;
        for (int64_t i = 0; i < t.numel(); ++i) {
          const double x = bf16_to_float(p[i]);
          run->finite &= std::isfinite(x);
          ss += x * x;
        }
        if (s.done()) {
          run->final_rms = t.numel() ? std::sqrt(ss / static_cast<double>(t.numel())) : 0.0;
          run->final_hidden.assign(p, p + t.numel());
        }
      }
    }
    ctx.state.finished = s.finished();
    ctx.state.steps = static_cast<int64_t>(s.steps().size());
    ctx.state.sim_us = s.clock_us();
    if (*ctx.progress) (*ctx.progress)(ctx.state);
  }
  if (run) run->digest = hex64(digest);
  if (out) *out = std::move(s);
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<LayerStack>> create_layer_stack(const std::string& backend,
                                                       const LayerStackConfig& config) {
  if (backend == "cpu") return create_cpu_layer_stack(config);
  if (backend == "cuda") {
#if defined(M3ATTN_WITH_CUDA)
    return create_cuda_layer_stack(config);
#else
    return unsupported("this m3attn was built without CUDA: use --backend cpu");
#endif
  }
  return invalid_argument("unknown backend '", backend, "' (expected cpu or cuda)");
}

const BenchRun* BenchReport::run(bool fused) const {
  for (const BenchRun& r : runs)
    if (r.fused == fused) return &r;
  return nullptr;
}

Result<BenchReport> run_bench(const BenchOptions& options, const BenchProgressFn& progress) {
  M3_RETURN_IF_ERROR(check_options(options));
  BenchReport rep;
  rep.options = options;
  rep.backend = options.backend;
  const Workload& w = options.workload;
  SchedulerOptions so;
  so.max_tokens_per_step = options.max_tokens_per_step;
  so.num_pages = options.num_pages;
  {
    // Validates the scheduler options and resolves the page count before anything is built.
    Result<Scheduler> probe = Scheduler::create(w, so);
    M3_RETURN_IF_ERROR(probe.status());
    so = probe.value().options();
  }
  rep.options.num_pages = so.num_pages;
  rep.pages_per_request = w.pages_per_request();

  LayerStackConfig cfg;
  cfg.geometry = options.geometry;
  cfg.num_dense = options.num_dense;
  cfg.num_sparse = options.num_sparse;
  cfg.num_pages = so.num_pages;
  cfg.max_tokens_per_step = options.max_tokens_per_step;
  cfg.max_requests_per_step = w.concurrency;
  cfg.max_pages_per_request = so.page_table_width;
  cfg.max_position = static_cast<int>(w.max_position());
  cfg.fuse_qkv_index_projection = options.run_fused;
  cfg.capture_mixed_front = options.capture_mixed_front;
  cfg.programmatic_launch = options.programmatic_launch;
  cfg.attention_quantize = options.attention_quantize;
  cfg.seed = w.seed;
  PagePoolConfig pc;
  pc.num_pages = cfg.num_pages;
  pc.num_layers = cfg.num_layers();
  pc.n_kv = cfg.geometry.n_kv;
  pc.with_index = cfg.num_sparse > 0;
  Result<PoolLayout> layout = PoolLayout::create(pc);
  M3_RETURN_IF_ERROR(layout.status());
  rep.pool_bytes = layout.value().total_bytes();

  Result<std::unique_ptr<LayerStack>> stack = create_layer_stack(options.backend, cfg);
  M3_RETURN_IF_ERROR(stack.status());
  rep.backend = stack.value()->backend();

  std::vector<bool> order;
  if (options.run_fused) order.push_back(true);
  if (options.run_unfused) order.push_back(false);
  static const BenchProgressFn kNoProgress;
  RunContext ctx;
  ctx.stack = stack.value().get();
  ctx.progress = progress ? &progress : &kNoProgress;
  ctx.state.runs = static_cast<int>(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    const bool fused = order[i];
    ctx.stack->set_fused(fused);
    ctx.state.run = static_cast<int>(i);
    ctx.state.fused = fused;
    if (options.warmup) {
      ctx.state.warmup = true;
      SchedulerOptions wo = so;
      M3_RETURN_IF_ERROR(
          drive(warmup_workload(w), wo, ctx, /*digest_every_step=*/false, nullptr, nullptr));
      ctx.state.warmup = false;
    }
    BenchRun run;
    run.fused = fused;
    Scheduler done;
    const auto start = std::chrono::steady_clock::now();
    M3_RETURN_IF_ERROR(drive(w, so, ctx, options.digest_every_step, &done, &run));
    run.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    run.metrics = compute_metrics(done.steps(), done.requests(), w.output_len);
    rep.runs.push_back(std::move(run));
  }
  const BenchRun* f = rep.run(true);
  const BenchRun* u = rep.run(false);
  if (f && u) {
    rep.compared = true;
    rep.digests_equal = f->digest == u->digest;
    double num = 0, den = 0;
    for (size_t k = 0; k < f->final_hidden.size() && k < u->final_hidden.size(); ++k) {
      const double a = bf16_to_float(f->final_hidden[k]);
      const double b = bf16_to_float(u->final_hidden[k]);
      num += (a - b) * (a - b);
      den += b * b;
    }
    rep.final_rel_l2 = den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
  }
  return rep;
}

namespace {

std::string fixed(double v, int precision) {
  if (!std::isfinite(v)) return "-";
  std::ostringstream os;
  os << std::fixed << std::setprecision(precision) << v;
  return os.str();
}

// NaN (JSON null, "-" in the table) when there is nothing to compare.
double ratio(double a, double b) { return b != 0 && std::isfinite(a) ? a / b : NAN; }

// Mean step time of a phase in ms; NaN when the run had no step of that phase.
double phase_ms(const PhaseStats& p) { return p.steps ? p.mean_us() * 1e-3 : NAN; }

struct Row {
  const char* name;
  double (*get)(const BenchRun&);
  int precision;
};

const Row kRows[] = {
    {"prefill-only step, mean (ms)", [](const BenchRun& r) { return phase_ms(r.metrics.prefill); },
     3},
    {"mixed step, mean (ms)", [](const BenchRun& r) { return phase_ms(r.metrics.mixed); }, 3},
    {"decode-only step, mean (ms)", [](const BenchRun& r) { return phase_ms(r.metrics.decode); },
     3},
    {"TTFT median (ms)", [](const BenchRun& r) { return r.metrics.ttft_median_us * 1e-3; }, 3},
    {"TTFT p90 (ms)", [](const BenchRun& r) { return r.metrics.ttft_p90_us * 1e-3; }, 3},
    {"TPOT median (ms)", [](const BenchRun& r) { return r.metrics.tpot_median_us * 1e-3; }, 4},
    {"TPOT p90 (ms)", [](const BenchRun& r) { return r.metrics.tpot_p90_us * 1e-3; }, 4},
    {"output tokens/s", [](const BenchRun& r) { return r.metrics.output_tokens_per_s; }, 1},
    {"total tokens/s (in + out)", [](const BenchRun& r) { return r.metrics.total_tokens_per_s; },
     1},
    {"duration (s, sum of steps)", [](const BenchRun& r) { return r.metrics.duration_us * 1e-6; },
     3},
};

}  // namespace

std::string BenchReport::to_text() const {
  const Workload& w = options.workload;
  std::ostringstream os;
  os << "m3attn bench: " << backend << " backend, " << options.geometry.to_string() << ", "
     << options.num_dense << " dense + " << options.num_sparse << " sparse layers\n";
  os << "workload: " << w.num_requests << " requests x (input " << w.input_len << ", output "
     << w.output_len << "), concurrency " << w.concurrency << ", draft " << w.draft_len << ", max "
     << options.max_tokens_per_step << " tokens/step, seed " << w.seed << "\n";
  os << "pool: " << options.num_pages << " pages (" << pages_per_request << " per request), "
     << fixed(static_cast<double>(pool_bytes) / (1024.0 * 1024.0), 1) << " MiB\n";
  os << "attention only: synthetic inputs, no sampler (each generation step counts 1 + draft "
        "tokens); times are sums of step times\n";
  if (!runs.empty()) {
    const ServingMetrics& m = runs[0].metrics;
    os << "steps: " << m.steps << " (prefill-only " << m.prefill.steps << ", mixed "
       << m.mixed.steps << ", decode-only " << m.decode.steps << "), tokens in " << m.input_tokens
       << ", out " << m.output_tokens << ", requests " << m.requests << "\n";
  }
  const BenchRun* f = run(true);
  const BenchRun* u = run(false);
  os << "\n" << std::left << std::setw(30) << "metric";
  for (const BenchRun& r : runs)
    os << std::right << std::setw(14) << (r.fused ? "fused" : "unfused");
  if (f && u) os << std::right << std::setw(16) << "fused/unfused";
  os << "\n";
  for (const Row& row : kRows) {
    os << std::left << std::setw(30) << row.name;
    for (const BenchRun& r : runs)
      os << std::right << std::setw(14) << fixed(row.get(r), row.precision);
    if (f && u) os << std::right << std::setw(16) << fixed(ratio(row.get(*f), row.get(*u)), 4);
    os << "\n";
  }
  os << "\n";
  for (const BenchRun& r : runs) {
    os << (r.fused ? "fused" : "unfused") << ": wall " << fixed(r.wall_s, 2) << " s";
    if (r.graph_replays) os << ", " << r.graph_replays << " steps replayed as graphs";
    os << ", final hidden rms " << fixed(r.final_rms, 5) << (r.finite ? "" : " NOT FINITE")
       << ", digest " << r.digest << "\n";
  }
  if (compared) {
    os << "fused vs unfused outputs: "
       << (options.digest_every_step
               ? (digests_equal ? "every step bit-identical" : "steps differ")
               : (digests_equal ? "last step bit-identical" : "last step differs"))
       << ", last step relative L2 " << std::scientific << std::setprecision(3) << final_rel_l2
       << "\n";
  }
  return os.str();
}

namespace {

nlohmann::json run_json(const BenchRun& r) {
  const ServingMetrics& m = r.metrics;
  auto phase = [](const PhaseStats& p) {
    return nlohmann::json{{"steps", p.steps},
                          {"tokens", p.tokens},
                          {"mean_ms", p.mean_us() * 1e-3},
                          {"total_ms", p.total_us * 1e-3}};
  };
  nlohmann::json j;
  j["steps"] = m.steps;
  j["duration_s"] = m.duration_us * 1e-6;
  j["wall_s"] = r.wall_s;
  j["phases"] = {
      {"prefill", phase(m.prefill)}, {"mixed", phase(m.mixed)}, {"decode", phase(m.decode)}};
  j["requests"] = m.requests;
  j["tokens"] = {{"input", m.input_tokens}, {"output", m.output_tokens}};
  j["ttft_ms"] = {{"median", m.ttft_median_us * 1e-3},
                  {"p90", m.ttft_p90_us * 1e-3},
                  {"mean", m.ttft_mean_us * 1e-3}};
  j["tpot_ms"] = {{"median", m.tpot_median_us * 1e-3},
                  {"p90", m.tpot_p90_us * 1e-3},
                  {"mean", m.tpot_mean_us * 1e-3}};
  j["output_tokens_per_s"] = m.output_tokens_per_s;
  j["total_tokens_per_s"] = m.total_tokens_per_s;
  j["graph_replays"] = r.graph_replays;
  j["final_hidden"] = {{"rms", r.final_rms}, {"finite", r.finite}, {"digest", r.digest}};
  return j;
}

}  // namespace

std::string BenchReport::to_json() const {
  const Workload& w = options.workload;
  nlohmann::json j;
  j["backend"] = backend;
  j["geometry"] = {{"hidden", options.geometry.hidden},
                   {"q_heads", options.geometry.n_q},
                   {"kv_heads", options.geometry.n_kv}};
  j["layers"] = {{"dense", options.num_dense}, {"sparse", options.num_sparse}};
  j["workload"] = {{"input_len", w.input_len},     {"output_len", w.output_len},
                   {"concurrency", w.concurrency}, {"requests", w.num_requests},
                   {"draft", w.draft_len},         {"seed", w.seed}};
  j["max_tokens_per_step"] = options.max_tokens_per_step;
  j["pool"] = {{"pages", options.num_pages},
               {"pages_per_request", pages_per_request},
               {"bytes", pool_bytes}};
  j["warmup"] = options.warmup;
  j["attention_only"] = true;
  nlohmann::json runs_j = nlohmann::json::object();
  for (const BenchRun& r : runs) runs_j[r.fused ? "fused" : "unfused"] = run_json(r);
  j["runs"] = runs_j;
  const BenchRun* f = run(true);
  const BenchRun* u = run(false);
  if (f && u) {
    nlohmann::json ratios = nlohmann::json::object();
    ratios["prefill_step"] = ratio(f->metrics.prefill.mean_us(), u->metrics.prefill.mean_us());
    ratios["mixed_step"] = ratio(f->metrics.mixed.mean_us(), u->metrics.mixed.mean_us());
    ratios["decode_step"] = ratio(f->metrics.decode.mean_us(), u->metrics.decode.mean_us());
    ratios["ttft_median"] = ratio(f->metrics.ttft_median_us, u->metrics.ttft_median_us);
    ratios["ttft_p90"] = ratio(f->metrics.ttft_p90_us, u->metrics.ttft_p90_us);
    ratios["tpot_median"] = ratio(f->metrics.tpot_median_us, u->metrics.tpot_median_us);
    ratios["tpot_p90"] = ratio(f->metrics.tpot_p90_us, u->metrics.tpot_p90_us);
    ratios["output_tokens_per_s"] =
        ratio(f->metrics.output_tokens_per_s, u->metrics.output_tokens_per_s);
    ratios["duration"] = ratio(f->metrics.duration_us, u->metrics.duration_us);
    j["fused_over_unfused"] = ratios;
    j["outputs"] = {{"every_step_hashed", options.digest_every_step},
                    {"bit_identical", digests_equal},
                    {"final_rel_l2", final_rel_l2}};
  }
  return j.dump();
}

}  // namespace m3attn
