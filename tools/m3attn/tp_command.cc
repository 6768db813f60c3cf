// `m3attn tp`: multi-GPU attention over NCCL, one process per GPU.
//
//   m3attn tp check --ranks P   TP-P layer output vs TP1 on the same weights and mixed batch
//                               (src/dist/tp_check.h): PASS / FAIL, exit 1 on FAIL
//   m3attn tp bench --ranks P --mode tp|dp
//                               the serving benchmark with attention tensor or data parallelism
//                               (src/engine/dist_bench.h): tokens/s total and per GPU
//
// The command started by the user is the launcher (src/dist/launcher.h): it checks that NCCL can
// be opened and that there are P devices, makes the NCCL unique id and re-executes this binary
// with the same arguments once per rank (M3ATTN_DIST_* variables, NCCL_NVLS_ENABLE=0). A process
// that finds those variables is rank r on device r. Rank 0 prints the result; the launcher reports
// the first rank that failed and stops the others (no hang), or a run past --timeout.
#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include "commands.h"
#include "dist/communicator.h"
#include "dist/launcher.h"
#include "dist/tp_check.h"
#include "engine/dist_bench.h"
#include "layer/layer_runner.h"

namespace m3attn::cli {

namespace {

struct TpFlags {
  int ranks = 2;
  double timeout_s = 600;
  bool json = false;
  std::string geometry = "m3";
  uint64_t seed = 1;
  bool unfused = false;
  // check
  bool dense = false, no_graph = false, simulate = false;  // simulate: check and bench
  int64_t prompt1 = 300, prompt2 = 77, chunk = 29;
  int check_draft = 2;
  // bench
  std::string mode = "tp";
  int64_t input_len = 2048, output_len = 64, max_tokens = 8192, pages = 0;
  int concurrency = 16, requests = 32, sparse = 2, dense_layers = 1, draft = 0;
  bool no_warmup = false;
};

MsaGeometry geometry_of(const std::string& name) {
  return name == "m3" ? MsaGeometry::m3() : default_layer_geometry();
}

// The parent: checks, unique id, one child per rank, supervision.
int launch(const TpFlags& f, const char* what) {
  force_nvls_off();
  std::string version;
  const Status nccl = nccl_available(&version);
  if (!nccl.ok()) {
    std::cerr << "m3attn tp " << what << ": NCCL is not available: " << nccl.to_string() << "\n";
    return 1;
  }
  const int devices = visible_cuda_devices();
  if (Status s = validate_ranks(f.ranks, devices); !s.ok()) {
    std::cerr << "m3attn tp " << what << ": " << s.to_string() << "\n";
    return exit_code_for(s);
  }
  Result<UniqueIdBytes> id = nccl_new_unique_id();
  Result<std::string> exe = self_executable();
  Result<std::vector<std::string>> args = self_command_line();
  for (const Status& s : {id.status(), exe.status(), args.status()}) {
    if (!s.ok()) {
      std::cerr << "m3attn tp " << what << ": " << s.to_string() << "\n";
      return 1;
    }
  }
  LaunchOptions lo;
  lo.argv = args.value();
  lo.argv[0] = exe.value();
  lo.ranks = f.ranks;
  lo.id = id.value();
  lo.timeout_s = f.timeout_s;
  std::cerr << "m3attn tp " << what << ": " << f.ranks << " ranks, one process per GPU (NCCL "
            << version << ", NCCL_NVLS_ENABLE=0)\n";
  Result<LaunchReport> rep = launch_ranks(lo);
  if (!rep.ok()) {
    std::cerr << "m3attn tp " << what << ": " << rep.status().to_string() << "\n";
    return 1;
  }
  if (!rep.value().ok()) {
    std::cerr << "m3attn tp " << what << ": FAILED: " << rep.value().summary() << "\n";
    const int first = rep.value().first_failed;
    const int code = first >= 0 ? rep.value().ranks[static_cast<size_t>(first)].exit_code : 1;
    return code > 0 && code < 126 ? code : 1;
  }
  return 0;
}

// A worker: joins the communicator on device `rank`, then runs `body`.
template <typename Body>
int work(const DistRole& role, const char* what, Body body) {
  force_nvls_off();
  Result<std::unique_ptr<Communicator>> comm =
      Communicator::create(role.id, role.size, role.rank, role.rank);
  if (!comm.ok()) {
    std::cerr << "m3attn tp " << what << " [rank " << role.rank
              << "]: " << comm.status().to_string() << "\n";
    return 1;
  }
  const int code = body(*comm.value());
  std::fflush(stdout);
  // Only after every rank is done does any rank tear its communicator down.
  if (code == 0) {
    const Status s = comm.value()->barrier();
    if (!s.ok()) {
      std::cerr << "m3attn tp " << what << " [rank " << role.rank
                << "]: final barrier: " << s.to_string() << "\n";
      return 1;
    }
  }
  return code;
}

TpCheckOptions check_options(const TpFlags& f) {
  TpCheckOptions o;
  o.geometry = geometry_of(f.geometry);
  o.sparse = !f.dense;
  o.fused = !f.unfused;
  o.seed = f.seed;
  o.prompt1 = f.prompt1;
  o.prompt2 = f.prompt2;
  o.chunk = f.chunk;
  o.draft_len = f.check_draft;
  o.graph = !f.no_graph;
  return o;
}

std::string check_title(const TpCheckOptions& o, int ranks, bool simulated) {
  std::ostringstream os;
  os << "m3attn tp check: TP" << ranks << " vs TP1"
     << (simulated ? " simulated on GPU 0 (rank layers in turn, partials summed on the host)" : "")
     << ", " << o.geometry.to_string() << ", " << (o.sparse ? "sparse" : "dense") << ", "
     << (o.fused ? "fused" : "unfused") << ", seed " << o.seed << "\n";
  return os.str();
}

// --simulate: every rank's layer in this process on GPU 0, no NCCL.
int simulate(const TpFlags& f) {
  if (visible_cuda_devices() < 1) {
    std::cerr << "m3attn tp check --simulate: needs a CUDA device, this machine has none\n";
    return 1;
  }
  const TpCheckOptions o = check_options(f);
  std::vector<TpCheckReport> reps;
  const Status s = run_tp_check_simulated(o, {f.ranks}, 0, &reps);
  if (!s.ok()) {
    std::cerr << "m3attn tp check --simulate: " << s.to_string() << "\n";
    return exit_code_for(s);
  }
  const TpCheckReport& rep = reps.at(0);
  std::cout << (f.json ? rep.to_json() + "\n" : check_title(o, f.ranks, true) + rep.to_text());
  return rep.pass() ? 0 : 1;
}

DistBenchOptions bench_options(const TpFlags& f) {
  DistBenchOptions o;
  o.backend = "cuda";
  o.geometry = geometry_of(f.geometry);
  o.num_dense = f.dense_layers;
  o.num_sparse = f.sparse;
  o.workload.input_len = f.input_len;
  o.workload.output_len = f.output_len;
  o.workload.concurrency = f.concurrency;
  o.workload.num_requests = f.requests;
  o.workload.draft_len = f.draft;
  o.workload.seed = f.seed;
  o.max_tokens_per_step = f.max_tokens;
  o.num_pages = f.pages;
  o.mode = f.mode == "dp" ? ParallelMode::kData : ParallelMode::kTensor;
  o.fused = !f.unfused;
  o.warmup = !f.no_warmup;
  return o;
}

// bench --simulate (attention-DP only): the ranks are threads of this process sharing GPU 0, in
// lock-step through in-process host collectives; no NCCL. Correctness of the DP loop (dealing,
// dummies, rollbacks) on the CUDA stack; the times are those of ranks sharing one GPU.
int simulate_bench(const TpFlags& f) {
  if (f.mode != "dp") {
    std::cerr << "m3attn tp bench --simulate: only --mode dp can run without NCCL\n";
    return 2;
  }
  if (visible_cuda_devices() < 1) {
    std::cerr << "m3attn tp bench --simulate: needs a CUDA device, this machine has none\n";
    return 1;
  }
  const DistBenchOptions o = bench_options(f);
  std::vector<std::unique_ptr<HostCollective>> group = make_thread_host_collectives(f.ranks);
  std::vector<Result<DistBenchReport>> reps(static_cast<size_t>(f.ranks),
                                            Result<DistBenchReport>(internal_error("not run")));
  std::vector<std::thread> threads;
  for (int r = 0; r < f.ranks; ++r)
    threads.emplace_back([&, r]() {
#if defined(M3ATTN_WITH_CUDA)
      const bool on_device = cudaSetDevice(0) == cudaSuccess;
#else
      const bool on_device = false;
#endif
      reps[static_cast<size_t>(r)] =
          on_device ? run_dist_bench_rank(o, *group[static_cast<size_t>(r)], nullptr)
                    : Result<DistBenchReport>(internal_error("cudaSetDevice(0) failed"));
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < f.ranks; ++r) {
    if (!reps[static_cast<size_t>(r)].ok()) {
      std::cerr << "m3attn tp bench --simulate [rank " << r
                << "]: " << reps[static_cast<size_t>(r)].status().to_string() << "\n";
      return exit_code_for(reps[static_cast<size_t>(r)].status());
    }
  }
  const DistBenchReport& rep = reps[0].value();
  std::cout << "(simulated: " << f.ranks << " DP ranks as threads sharing GPU 0; tokens/s are not "
            << "per-GPU numbers)\n"
            << (f.json ? rep.to_json() + "\n" : rep.to_text());
  return rep.finite && rep.rollbacks_verified ? 0 : 1;
}

void add_common(CLI::App* cmd, TpFlags* f) {
  cmd->add_option("--ranks", f->ranks, "Ranks = GPUs, one process each (default 2)")
      ->check(CLI::Range(1, kMaxRanks));
  cmd->add_option("--timeout", f->timeout_s,
                  "Seconds before the launcher stops every rank (default 600; 0 = none)")
      ->check(CLI::Range(0.0, 86400.0));
  cmd->add_option("--geometry", f->geometry,
                  "m3 (hidden 6144, 64 q / 4 kv heads; default) or small (hidden 1024, 8 q / 2 kv)")
      ->check(CLI::IsMember({"m3", "small"}));
  cmd->add_option("--seed", f->seed, "Seed of the random weights and inputs");
  cmd->add_flag("--unfused", f->unfused, "Unfused projection + producer (default fused)");
  cmd->add_flag("--json", f->json, "Print one JSON object (rank 0) instead of text");
}

}  // namespace

void add_tp_command(CLI::App& app, int& exit_code) {
  CLI::App* tp = app.add_subcommand(
      "tp",
      "Multi-GPU attention over NCCL, one process per GPU started by this command (no mpirun): "
      "'check' compares the tensor-parallel layer with TP1, 'bench' runs the serving benchmark "
      "with attention tensor (--mode tp) or data (--mode dp) parallelism.");
  tp->require_subcommand(1);
  auto f = std::make_shared<TpFlags>();

  CLI::App* check = tp->add_subcommand(
      "check",
      "TP-P layer output (rank partials all-reduced through NCCL) vs TP1 on GPU 0, same random "
      "weights and steps (two prefills, a mixed step, a decode step with drafts): max / relative "
      "L2 difference against a derived bound, PASS or FAIL (exit 1).");
  add_common(check, f.get());
  check->add_flag("--dense", f->dense, "Check a dense layer (default: sparse MSA layer)");
  check->add_flag("--simulate", f->simulate,
                  "One process, GPU 0, no NCCL: the --ranks rank layers run in turn and their "
                  "partials are summed on the host (any P, e.g. 4 or 8 on one GPU)");
  check->add_flag("--no-graph", f->no_graph,
                  "Skip the CUDA-graph replay of the last step (layer + all-reduce captured)");
  check->add_option("--prompt1", f->prompt1, "First prompt (default 300)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  check->add_option("--prompt2", f->prompt2, "Second prompt (default 77)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  check->add_option("--chunk", f->chunk, "Prompt chunk of the mixed step (default 29)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  check->add_option("--draft", f->check_draft, "Draft tokens of the generation requests (2)")
      ->check(CLI::Range(0, 64));
  check->callback([f, &exit_code]() {
    Result<DistRole> role = dist_role_from_env();
    if (!role.ok()) {
      std::cerr << "m3attn tp check: " << role.status().to_string() << "\n";
      exit_code = 2;
      return;
    }
    if (f->simulate) {
      exit_code = simulate(*f);
      return;
    }
    if (!role.value().worker) {
      exit_code = launch(*f, "check");
      return;
    }
    exit_code = work(role.value(), "check", [&](Communicator& comm) {
      const TpCheckOptions o = check_options(*f);
      TpCheckReport rep;
      const Status s = run_tp_check_rank(comm, o, &rep);
      if (!s.ok()) {
        std::cerr << "m3attn tp check [rank " << comm.rank() << "]: " << s.to_string() << "\n";
        return exit_code_for(s);
      }
      if (comm.rank() != 0) return 0;
      std::cout << (f->json ? rep.to_json() + "\n"
                            : check_title(o, comm.size(), false) + rep.to_text());
      return rep.pass() ? 0 : 1;
    });
  });

  CLI::App* bench = tp->add_subcommand(
      "bench",
      "Serving benchmark across ranks: --mode tp (every rank runs its head shard of every layer, "
      "o_proj partials all-reduced) or --mode dp (requests dealt over the ranks, lock-step steps, "
      "an idle rank runs a dummy generation request rolled back afterwards). Reports tokens/s "
      "total and per GPU. Defaults: m3 geometry, 1 dense + 2 sparse layers, 32 requests x (2048 "
      "in, 64 out), concurrency 16.");
  add_common(bench, f.get());
  bench->add_option("--mode", f->mode, "tp (tensor parallel, default) or dp (data parallel)")
      ->check(CLI::IsMember({"tp", "dp"}));
  bench->add_option("--input-len", f->input_len, "Prompt tokens per request")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  bench->add_option("--output-len", f->output_len, "Generated tokens per request")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  bench->add_option("--concurrency", f->concurrency, "Requests in flight, whole run")
      ->check(CLI::Range(1, 1 << 30));
  bench->add_option("--requests", f->requests, "Requests in the run, whole run")
      ->check(CLI::Range(1, 1 << 30));
  bench->add_option("--layers", f->sparse, "MSA (sparse) layers (default 2)")
      ->check(CLI::Range(0, 256));
  bench->add_option("--dense-layers", f->dense_layers, "Dense layers first (default 1)")
      ->check(CLI::Range(0, 256));
  bench->add_option("--max-tokens-per-step", f->max_tokens, "Token budget of a step per rank")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  bench->add_option("--draft", f->draft, "Draft tokens per generation step")
      ->check(CLI::Range(0, 64));
  bench->add_option("--pages", f->pages, "KV pool pages per rank")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  bench->add_flag("--no-warmup", f->no_warmup, "Skip the unmeasured warm-up");
  bench->add_flag("--simulate", f->simulate,
                  "--mode dp only: the ranks as threads of one process sharing GPU 0, no NCCL "
                  "(checks the DP loop and dummies on the CUDA stack; times are not per GPU)");
  bench->callback([f, &exit_code]() {
    Result<DistRole> role = dist_role_from_env();
    if (!role.ok()) {
      std::cerr << "m3attn tp bench: " << role.status().to_string() << "\n";
      exit_code = 2;
      return;
    }
    if (f->simulate) {
      exit_code = simulate_bench(*f);
      return;
    }
    if (!role.value().worker) {
      exit_code = launch(*f, "bench");
      return;
    }
    exit_code = work(role.value(), "bench", [&](Communicator& comm) {
      const DistBenchOptions o = bench_options(*f);
      Result<std::unique_ptr<HostCollective>> coll = make_nccl_host_collective(&comm);
      if (!coll.ok()) {
        std::cerr << "m3attn tp bench [rank " << comm.rank() << "]: " << coll.status().to_string()
                  << "\n";
        return 1;
      }
      Result<DistBenchReport> rep = run_dist_bench_rank(o, *coll.value(), &comm);
      if (!rep.ok()) {
        std::cerr << "m3attn tp bench [rank " << comm.rank() << "]: " << rep.status().to_string()
                  << "\n";
        return exit_code_for(rep.status());
      }
      if (comm.rank() != 0) return 0;
      std::cout << (f->json ? rep.value().to_json() + "\n" : rep.value().to_text());
      const bool ok = rep.value().finite && rep.value().rollbacks_verified;
      return ok ? 0 : 1;
    });
  });
}

}  // namespace m3attn::cli
