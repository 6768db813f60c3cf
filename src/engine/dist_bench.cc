#include "engine/dist_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <utility>

#include "cache/dp_dummy.h"
#include "core/numeric.h"
#include "dist/communicator.h"

namespace m3attn {

namespace {

int share(int64_t n, int r, int p) { return static_cast<int>(n / p + (r < n % p ? 1 : 0)); }

Status check_options(const DistBenchOptions& o, int ranks) {
  M3_CHECK_ARG(o.backend == "cpu" || o.backend == "cuda", "unknown backend '", o.backend,
               "' (expected cpu or cuda)");
  M3_RETURN_IF_ERROR(o.geometry.validate());
  M3_CHECK_ARG(o.num_dense >= 0 && o.num_sparse >= 0 && o.num_dense + o.num_sparse >= 1,
               "the stack needs at least one layer, got ", o.num_dense, " dense and ", o.num_sparse,
               " sparse");
  M3_RETURN_IF_ERROR(o.workload.validate());
  M3_CHECK_ARG(o.draft_pages >= 0, "draft pages must be >= 0, got ", o.draft_pages);
  if (o.mode == ParallelMode::kTensor) {
    M3_CHECK_ARG(ranks == 1 || o.backend == "cuda",
                 "attention tensor parallelism runs on the cuda backend only");
  }
  return Status::Ok();
}

// Idle-rank dummy step: admit, run, roll back; checks both caches are as before.
Status dummy_step(LayerStack& stack, CacheManager& target, CacheManager& draft, int draft_len,
                  int width, double* step_us, bool* restored, int64_t* replays) {
  const int64_t free_t = target.num_free_pages(), free_d = draft.num_free_pages();
  const size_t req_t = target.num_requests(), req_d = draft.num_requests();
  Result<DummyGeneration> d = DummyGeneration::begin(target, &draft, draft_len);
  M3_RETURN_IF_ERROR(d.status());
  Result<StepPlan> plan = d.value().target_plan(width);
  M3_RETURN_IF_ERROR(plan.status());
  StackStepStats st;
  const Status run = stack.step(plan.value(), &st);
  const Status end = d.value().end();  // roll back even when the step failed
  M3_RETURN_IF_ERROR(run);
  M3_RETURN_IF_ERROR(end);
  *step_us = st.step_us;
  *replays += st.graph_replay ? 1 : 0;
  *restored &= target.num_free_pages() == free_t && draft.num_free_pages() == free_d &&
               target.num_requests() == req_t && draft.num_requests() == req_d;
  return Status::Ok();
}

struct RankRun {
  int64_t steps = 0, dummy_steps = 0, graph_replays = 0;
  double clock_us = 0;
  bool restored = true;
  std::optional<Scheduler> sched;
};

// One lock-step run of `w` (this rank's share for kData, the whole workload for kTensor).
Status drive(const DistBenchOptions& o, const Workload& w, const SchedulerOptions& so,
             LayerStack& stack, HostCollective& coll, CacheManager& idle_target,
             CacheManager& draft, RankRun* out) {
  const bool dp = o.mode == ParallelMode::kData;
  RankRun& run = *out;
  if (w.num_requests > 0) {
    Result<Scheduler> s = Scheduler::create(w, so);
    M3_RETURN_IF_ERROR(s.status());
    run.sched.emplace(std::move(s.value()));
  }
  std::vector<double> v(1);
  for (;;) {
    const bool has = run.sched && !run.sched->done();
    if (dp) {
      v[0] = has ? 1 : 0;
      M3_RETURN_IF_ERROR(coll.all_reduce(&v, CollectiveOp::kSum));
      if (v[0] == 0) break;
    } else if (!has) {
      break;  // kTensor: every rank runs the same schedule
    }
    double us = 0;
    std::optional<StepPlan> plan;
    if (has) {
      Result<StepPlan> p = run.sched->next_step();
      M3_RETURN_IF_ERROR(p.status());
      plan.emplace(std::move(p.value()));
      StackStepStats st;
      M3_RETURN_IF_ERROR(stack.step(*plan, &st));
      us = st.step_us;
      run.graph_replays += st.graph_replay ? 1 : 0;
    } else {
      CacheManager& target = run.sched ? run.sched->mutable_cache() : idle_target;
      M3_RETURN_IF_ERROR(dummy_step(stack, target, draft, w.draft_len, so.page_table_width, &us,
                                    &run.restored, &run.graph_replays));
      ++run.dummy_steps;
    }
    v[0] = us;
    M3_RETURN_IF_ERROR(coll.all_reduce(&v, CollectiveOp::kMax));
    if (has) M3_RETURN_IF_ERROR(run.sched->finish_step(*plan, v[0]));
    run.clock_us += v[0];
    ++run.steps;
  }
  return Status::Ok();
}

}  // namespace

const char* parallel_mode_name(ParallelMode mode) {
  return mode == ParallelMode::kTensor ? "tp" : "dp";
}

Result<DistBenchReport> run_dist_bench_rank(const DistBenchOptions& o, HostCollective& coll,
                                            Communicator* tp_comm) {
  const int P = coll.size(), rank = coll.rank();
  M3_RETURN_IF_ERROR(check_options(o, P));
  const bool dp = o.mode == ParallelMode::kData;
  if (!dp && P > 1) {
    M3_CHECK_ARG(tp_comm != nullptr && tp_comm->size() == P && tp_comm->rank() == rank,
                 "attention tensor parallelism needs a communicator of rank ", rank, " of ", P);
  }
  const Workload& global = o.workload;
  // This rank's workload and the stack capacity (the same on every rank).
  Workload mine = global;
  int cap_requests = global.concurrency;
  if (dp) {
    mine.num_requests = share(global.num_requests, rank, P);
    mine.concurrency = std::max(1, share(global.concurrency, rank, P));
    cap_requests = std::max(1, share(global.concurrency, 0, P));
  }
  const int64_t ppr = global.pages_per_request();
  SchedulerOptions so;
  so.max_tokens_per_step = o.max_tokens_per_step;
  so.num_pages = o.num_pages > 0 ? o.num_pages : int64_t{cap_requests} * ppr;
  so.page_table_width = static_cast<int>(ppr);
  {
    Workload probe = mine;
    probe.num_requests = std::max(1, probe.num_requests);
    Result<Scheduler> s = Scheduler::create(probe, so);  // validates the options
    M3_RETURN_IF_ERROR(s.status());
  }

  LayerStackConfig cfg;
  cfg.geometry = o.geometry;
  cfg.num_dense = o.num_dense;
  cfg.num_sparse = o.num_sparse;
  cfg.num_pages = so.num_pages;
  cfg.max_tokens_per_step = o.max_tokens_per_step;
  cfg.max_requests_per_step = cap_requests;
  cfg.max_pages_per_request = so.page_table_width;
  cfg.max_position = static_cast<int>(global.max_position());
  cfg.fuse_qkv_index_projection = o.fused;
  cfg.seed = global.seed;
  if (!dp) {
    cfg.tp_size = P;
    cfg.tp_rank = rank;
    cfg.tp_comm = P > 1 ? tp_comm : nullptr;
  }
  Result<std::unique_ptr<LayerStack>> stack = create_layer_stack(o.backend, cfg);
  M3_RETURN_IF_ERROR(stack.status());
  LayerStack& st = *stack.value();

  CacheManager idle_target(so.num_pages);
  CacheManager draft(o.draft_pages > 0 ? o.draft_pages : 64, /*tokens_per_page=*/32);
  RankRun warm, run;
  if (o.warmup) {
    Workload w = mine;
    w.input_len = std::min<int64_t>(global.input_len, 256);
    w.output_len = std::min<int64_t>(global.output_len, 4);
    w.num_requests = mine.num_requests > 0 ? mine.concurrency : 0;
    M3_RETURN_IF_ERROR(drive(o, w, so, st, coll, idle_target, draft, &warm));
  }
  const auto start = std::chrono::steady_clock::now();
  M3_RETURN_IF_ERROR(drive(o, mine, so, st, coll, idle_target, draft, &run));
  const double wall_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  DistBenchReport rep;
  rep.options = o;
  rep.ranks = P;
  rep.steps = run.steps;
  rep.duration_us = run.clock_us;
  rep.wall_s = wall_s;
  rep.graph_replays = run.graph_replays;
  ServingMetrics m;
  if (run.sched) m = compute_metrics(run.sched->steps(), run.sched->requests(), global.output_len);
  rep.rank0 = m;

  // Last hidden states of this rank (its last real step; a dummy-only rank has none).
  double rms = 0;
  bool finite = true;
  if (run.sched) {
    Result<Tensor> h = st.last_hidden();
    M3_RETURN_IF_ERROR(h.status());
    const Tensor& t = h.value();
    double ss = 0;
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double x = bf16_to_float(t.ptr<uint16_t>()[i]);
      finite &= std::isfinite(x);
      ss += x * x;
    }
    rms = t.numel() ? std::sqrt(ss / static_cast<double>(t.numel())) : 0.0;
  }
  rep.final_rms = rms;

  // Totals and per-rank facts: [requests, in, out, not finite, not restored, dealt[P], dummy[P]].
  std::vector<double> v(static_cast<size_t>(5 + 2 * P), 0.0);
  const bool count = dp || rank == 0;
  v[0] = count ? m.requests : 0;
  v[1] = count ? static_cast<double>(m.input_tokens) : 0;
  v[2] = count ? static_cast<double>(m.output_tokens) : 0;
  v[3] = finite ? 0 : 1;
  v[4] = run.restored && warm.restored ? 0 : 1;
  v[static_cast<size_t>(5 + rank)] = mine.num_requests;
  v[static_cast<size_t>(5 + P + rank)] = static_cast<double>(run.dummy_steps);
  M3_RETURN_IF_ERROR(coll.all_reduce(&v, CollectiveOp::kSum));
  rep.requests = static_cast<int>(v[0]);
  rep.input_tokens = static_cast<int64_t>(v[1]);
  rep.output_tokens = static_cast<int64_t>(v[2]);
  rep.finite = v[3] == 0;
  rep.rollbacks_verified = v[4] == 0;
  for (int r = 0; r < P; ++r) {
    rep.rank_requests.push_back(static_cast<int>(v[static_cast<size_t>(5 + r)]));
    rep.dummy_steps.push_back(static_cast<int64_t>(v[static_cast<size_t>(5 + P + r)]));
  }
  const double secs = rep.duration_us * 1e-6;
  if (secs > 0) {
    rep.output_tokens_per_s = static_cast<double>(rep.output_tokens) / secs;
    rep.total_tokens_per_s = static_cast<double>(rep.input_tokens + rep.output_tokens) / secs;
  }
  rep.output_tokens_per_s_per_gpu = rep.output_tokens_per_s / P;
  rep.total_tokens_per_s_per_gpu = rep.total_tokens_per_s / P;
  return rep;
}

namespace {

std::string fixed(double v, int precision) {
  if (!std::isfinite(v)) return "-";
  std::ostringstream os;
  os << std::fixed << std::setprecision(precision) << v;
  return os.str();
}

}  // namespace

std::string DistBenchReport::to_text() const {
  const DistBenchOptions& o = options;
  const Workload& w = o.workload;
  const bool dp = o.mode == ParallelMode::kData;
  std::ostringstream os;
  os << "m3attn tp bench: attention " << (dp ? "data" : "tensor") << " parallelism, "
     << (dp ? "DP" : "TP") << ranks << ", " << o.backend << " backend, " << o.geometry.to_string()
     << " (TP1), " << o.num_dense << " dense + " << o.num_sparse << " sparse layers, "
     << (o.fused ? "fused" : "unfused") << "\n";
  os << "workload (whole run): " << w.num_requests << " requests x (input " << w.input_len
     << ", output " << w.output_len << "), concurrency " << w.concurrency << ", draft "
     << w.draft_len << ", max " << o.max_tokens_per_step << " tokens/step per rank, seed " << w.seed
     << "\n";
  if (dp) {
    os << "requests per rank:";
    for (int r : rank_requests) os << " " << r;
    os << "; dummy steps per rank:";
    for (int64_t d : dummy_steps) os << " " << d;
    os << "; dummy rollbacks " << (rollbacks_verified ? "verified" : "NOT restored") << "\n";
  }
  os << "lock-step steps " << steps << ", duration " << fixed(duration_us * 1e-6, 4)
     << " s (sum of the slowest rank's step times), wall " << fixed(wall_s, 2) << " s\n";
  os << "tokens: in " << input_tokens << ", out " << output_tokens << ", requests " << requests
     << "\n";
  os << std::left << std::setw(28) << "" << std::right << std::setw(14) << "total" << std::setw(14)
     << "per GPU"
     << "\n";
  os << std::left << std::setw(28) << "output tokens/s" << std::right << std::setw(14)
     << fixed(output_tokens_per_s, 1) << std::setw(14) << fixed(output_tokens_per_s_per_gpu, 1)
     << "\n";
  os << std::left << std::setw(28) << "total tokens/s (in + out)" << std::right << std::setw(14)
     << fixed(total_tokens_per_s, 1) << std::setw(14) << fixed(total_tokens_per_s_per_gpu, 1)
     << "\n";
  os << "rank 0: TTFT median " << fixed(rank0.ttft_median_us * 1e-3, 3) << " ms, TPOT median "
     << fixed(rank0.tpot_median_us * 1e-3, 4) << " ms, decode step mean "
     << fixed(rank0.decode.steps ? rank0.decode.mean_us() * 1e-3 : NAN, 3) << " ms, "
     << graph_replays << " graph replays, final hidden rms " << fixed(final_rms, 5)
     << (finite ? "" : ", NOT FINITE") << "\n";
  return os.str();
}

std::string DistBenchReport::to_json() const {
  const DistBenchOptions& o = options;
  const Workload& w = o.workload;
  nlohmann::json j;
  j["mode"] = parallel_mode_name(o.mode);
  j["ranks"] = ranks;
  j["backend"] = o.backend;
  j["geometry"] = {
      {"hidden", o.geometry.hidden}, {"q_heads", o.geometry.n_q}, {"kv_heads", o.geometry.n_kv}};
  j["layers"] = {{"dense", o.num_dense}, {"sparse", o.num_sparse}};
  j["fused"] = o.fused;
  j["workload"] = {{"input_len", w.input_len},     {"output_len", w.output_len},
                   {"concurrency", w.concurrency}, {"requests", w.num_requests},
                   {"draft", w.draft_len},         {"seed", w.seed}};
  j["max_tokens_per_step"] = o.max_tokens_per_step;
  j["steps"] = steps;
  j["duration_s"] = duration_us * 1e-6;
  j["wall_s"] = wall_s;
  j["requests"] = requests;
  j["tokens"] = {{"input", input_tokens}, {"output", output_tokens}};
  j["output_tokens_per_s"] = output_tokens_per_s;
  j["total_tokens_per_s"] = total_tokens_per_s;
  j["output_tokens_per_s_per_gpu"] = output_tokens_per_s_per_gpu;
  j["total_tokens_per_s_per_gpu"] = total_tokens_per_s_per_gpu;
  j["rank0"] = {{"ttft_median_ms", rank0.ttft_median_us * 1e-3},
                {"tpot_median_ms", rank0.tpot_median_us * 1e-3},
                {"decode_step_mean_ms", rank0.decode.mean_us() * 1e-3},
                {"graph_replays", graph_replays},
                {"final_rms", final_rms}};
  j["rank_requests"] = rank_requests;
  j["dummy_steps"] = dummy_steps;
  j["rollbacks_verified"] = rollbacks_verified;
  j["finite"] = finite;
  return j.dump();
}

}  // namespace m3attn
