#include "dist/launcher.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

extern char** environ;

namespace m3attn {

namespace {

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

Result<int> parse_int(const char* what, const char* text) {
  if (text == nullptr || *text == '\0') return invalid_argument(what, " is empty");
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < INT_MIN || v > INT_MAX)
    return invalid_argument(what, " '", text, "' is not an integer");
  return static_cast<int>(v);
}

}  // namespace

std::string encode_unique_id(const UniqueIdBytes& id) {
  static const char kDigits[] = "0123456789abcdef";
  std::string s(2 * id.size(), '0');
  for (size_t i = 0; i < id.size(); ++i) {
    s[2 * i] = kDigits[id[i] >> 4];
    s[2 * i + 1] = kDigits[id[i] & 15];
  }
  return s;
}

Result<UniqueIdBytes> decode_unique_id(const std::string& hex) {
  M3_CHECK_ARG(hex.size() == 2 * kUniqueIdBytes, "unique id must be ", 2 * kUniqueIdBytes,
               " hex digits, got ", hex.size(), " characters");
  UniqueIdBytes id{};
  for (size_t i = 0; i < hex.size(); ++i) {
    const int v = hex_value(hex[i]);
    M3_CHECK_ARG(v >= 0, "unique id character ", i, " ('", hex[i], "') is not a hex digit");
    id[i / 2] = static_cast<uint8_t>(i % 2 == 0 ? v << 4 : id[i / 2] | v);
  }
  return id;
}

void force_nvls_off() { setenv("NCCL_NVLS_ENABLE", "0", 1); }

Result<DistRole> dist_role_from_env(const EnvGetter& getenv_fn) {
  auto get = [&](const char* name) -> const char* {
    return getenv_fn ? getenv_fn(name) : std::getenv(name);
  };
  const char* rank = get(kEnvDistRank);
  const char* size = get(kEnvDistSize);
  const char* id = get(kEnvDistId);
  DistRole role;
  if (rank == nullptr && size == nullptr && id == nullptr) return role;
  M3_CHECK_ARG(rank != nullptr && size != nullptr && id != nullptr, "a worker needs ", kEnvDistRank,
               ", ", kEnvDistSize, " and ", kEnvDistId, " together; ", rank ? "" : kEnvDistRank,
               rank ? "" : " ", size ? "" : kEnvDistSize, size ? "" : " ", id ? "" : kEnvDistId,
               " missing");
  Result<int> r = parse_int(kEnvDistRank, rank);
  M3_RETURN_IF_ERROR(r.status());
  Result<int> p = parse_int(kEnvDistSize, size);
  M3_RETURN_IF_ERROR(p.status());
  M3_CHECK_ARG(p.value() >= 1 && p.value() <= kMaxRanks, kEnvDistSize, " must be in [1, ",
               kMaxRanks, "], got ", p.value());
  M3_CHECK_ARG(r.value() >= 0 && r.value() < p.value(), kEnvDistRank, " must be in [0, ", p.value(),
               "), got ", r.value());
  Result<UniqueIdBytes> u = decode_unique_id(id);
  M3_RETURN_IF_ERROR(u.status());
  role.worker = true;
  role.rank = r.value();
  role.size = p.value();
  role.id = u.value();
  return role;
}

Status validate_ranks(int ranks, int device_count) {
  M3_CHECK_ARG(ranks >= 1 && ranks <= kMaxRanks, "ranks must be in [1, ", kMaxRanks, "], got ",
               ranks);
  if (ranks > device_count)
    return resource_exhausted("ranks: ", ranks, " ranks need ", ranks,
                              " CUDA devices (one per rank), this machine has ", device_count);
  return Status::Ok();
}

std::string LaunchReport::summary() const {
  std::ostringstream os;
  bool first = true;
  auto sep = [&]() {
    if (!first) os << "; ";
    first = false;
  };
  if (timed_out) {
    sep();
    os << "time limit reached";
  }
  if (first_failed >= 0) {
    sep();
    os << "rank " << first_failed << " failed first";
  }
  for (const RankExit& r : ranks) {
    if (r.exit_code == 0 && r.signal == 0) continue;
    sep();
    os << "rank " << r.rank << " (pid " << r.pid << ") ";
    if (r.stopped_by_launcher) os << "stopped by the launcher, ";
    if (r.signal != 0)
      os << "killed by signal " << r.signal << " (" << strsignal(r.signal) << ")";
    else
      os << "exited with code " << r.exit_code;
  }
  if (first) os << "all " << ranks.size() << " ranks exited with code 0";
  return os.str();
}

Result<std::string> self_executable() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return io_error("cannot read /proc/self/exe: ", std::strerror(errno));
  buf[n] = '\0';
  return std::string(buf);
}

Result<std::vector<std::string>> self_command_line() {
  FILE* f = std::fopen("/proc/self/cmdline", "rb");
  if (!f) return io_error("cannot open /proc/self/cmdline: ", std::strerror(errno));
  std::string all;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) all.append(buf, n);
  std::fclose(f);
  std::vector<std::string> args;
  size_t at = 0;
  while (at < all.size()) {
    const size_t end = all.find('\0', at);
    args.push_back(all.substr(at, end == std::string::npos ? std::string::npos : end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  if (args.empty()) return io_error("/proc/self/cmdline is empty");
  return args;
}

int visible_cuda_devices() {
#if defined(M3ATTN_WITH_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

Result<LaunchReport> launch_ranks(const LaunchOptions& o) {
  M3_CHECK_ARG(!o.argv.empty() && !o.argv[0].empty(), "launch: empty command line");
  M3_CHECK_ARG(o.ranks >= 1 && o.ranks <= kMaxRanks, "launch: ranks must be in [1, ", kMaxRanks,
               "], got ", o.ranks);
  M3_CHECK_ARG(o.grace_s >= 0, "launch: grace period must be >= 0, got ", o.grace_s);
  for (const auto& [k, v] : o.extra_env) {
    M3_CHECK_ARG(!k.empty() && k.find('=') == std::string::npos, "launch: bad variable name '", k,
                 "'");
    M3_CHECK_ARG(k != "NCCL_NVLS_ENABLE", "launch: NCCL_NVLS_ENABLE is forced to 0 in every rank",
                 " (NVLink multicast stays off); it cannot be set to '", v, "'");
    M3_CHECK_ARG(k != kEnvDistRank && k != kEnvDistSize && k != kEnvDistId, "launch: ", k,
                 " is set by the launcher");
  }
  const std::string id_hex = encode_unique_id(o.id);
  std::vector<char*> args;
  for (const std::string& a : o.argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  LaunchReport rep;
  rep.ranks.resize(static_cast<size_t>(o.ranks));
  std::vector<bool> running(static_cast<size_t>(o.ranks), false);
  using Clock = std::chrono::steady_clock;

  auto reap = [&](int r, int status) {
    RankExit& e = rep.ranks[static_cast<size_t>(r)];
    running[static_cast<size_t>(r)] = false;
    if (WIFEXITED(status)) {
      e.exit_code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
      e.signal = WTERMSIG(status);
    }
    if ((e.exit_code != 0 || e.signal != 0) && rep.first_failed < 0 && !e.stopped_by_launcher)
      rep.first_failed = r;
  };
  // SIGTERM to every running child, SIGKILL after the grace period; reaps them all.
  auto stop_all = [&]() {
    for (int r = 0; r < o.ranks; ++r) {
      if (!running[static_cast<size_t>(r)]) continue;
      rep.ranks[static_cast<size_t>(r)].stopped_by_launcher = true;
      kill(rep.ranks[static_cast<size_t>(r)].pid, SIGTERM);
    }
    const auto deadline = Clock::now() + std::chrono::duration<double>(o.grace_s);
    bool killed = false;
    for (;;) {
      bool any = false;
      for (int r = 0; r < o.ranks; ++r) {
        if (!running[static_cast<size_t>(r)]) continue;
        int status = 0;
        const pid_t w = waitpid(rep.ranks[static_cast<size_t>(r)].pid, &status, WNOHANG);
        if (w == rep.ranks[static_cast<size_t>(r)].pid || (w < 0 && errno == ECHILD)) {
          if (w < 0) status = 0;
          reap(r, status);
        } else {
          any = true;
        }
      }
      if (!any) return;
      if (!killed && Clock::now() >= deadline) {
        for (int r = 0; r < o.ranks; ++r)
          if (running[static_cast<size_t>(r)]) kill(rep.ranks[static_cast<size_t>(r)].pid, SIGKILL);
        killed = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  };

  // Every child's environment is built here: between fork and exec only async-signal-safe calls
  // are allowed (the parent may run threads, e.g. NCCL's bootstrap root).
  std::vector<std::vector<std::string>> envs(static_cast<size_t>(o.ranks));
  std::vector<std::vector<char*>> envps(static_cast<size_t>(o.ranks));
  for (int r = 0; r < o.ranks; ++r) {
    std::vector<std::pair<std::string, std::string>> set = {{kEnvDistRank, std::to_string(r)},
                                                            {kEnvDistSize, std::to_string(o.ranks)},
                                                            {kEnvDistId, id_hex},
                                                            {"NCCL_NVLS_ENABLE", "0"}};
    for (const auto& kv : o.extra_env) set.push_back(kv);
    std::vector<std::string>& env = envs[static_cast<size_t>(r)];
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      const std::string entry = *e;
      const std::string name = entry.substr(0, entry.find('='));
      bool replaced = false;
      for (const auto& kv : set) replaced |= kv.first == name;
      if (!replaced) env.push_back(entry);
    }
    // Later duplicates win: the last assignment of a name is the one kept.
    for (size_t i = 0; i < set.size(); ++i) {
      bool later = false;
      for (size_t j = i + 1; j < set.size(); ++j) later |= set[j].first == set[i].first;
      if (!later) env.push_back(set[i].first + "=" + set[i].second);
    }
    for (std::string& e : env) envps[static_cast<size_t>(r)].push_back(e.data());
    envps[static_cast<size_t>(r)].push_back(nullptr);
  }

  std::fflush(nullptr);  // no buffered output duplicated into the children
  const pid_t parent = getpid();
  for (int r = 0; r < o.ranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      const std::string why = std::strerror(errno);
      stop_all();
      return internal_error("launch: fork for rank ", r, " failed: ", why);
    }
    if (pid == 0) {
      // Child: only async-signal-safe calls until execve. The rank dies with the launcher
      // (PR_SET_PDEATHSIG survives execve), so a killed launcher leaves no rank holding a GPU.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(126);  // the launcher died before prctl
      execve(args[0], args.data(), envps[static_cast<size_t>(r)].data());
      const char msg[] = "m3attn launcher: execve failed\n";
      ssize_t ignored = write(STDERR_FILENO, msg, sizeof(msg) - 1);
      (void)ignored;
      _exit(127);
    }
    rep.ranks[static_cast<size_t>(r)].rank = r;
    rep.ranks[static_cast<size_t>(r)].pid = pid;
    running[static_cast<size_t>(r)] = true;
  }

  const auto start = Clock::now();
  for (;;) {
    bool any = false;
    for (int r = 0; r < o.ranks; ++r) {
      if (!running[static_cast<size_t>(r)]) continue;
      int status = 0;
      const pid_t w = waitpid(rep.ranks[static_cast<size_t>(r)].pid, &status, WNOHANG);
      if (w == rep.ranks[static_cast<size_t>(r)].pid) {
        reap(r, status);
      } else {
        any = true;
      }
    }
    if (!any) break;
    if (rep.first_failed >= 0) {
      stop_all();
      break;
    }
    if (o.timeout_s > 0 && Clock::now() - start > std::chrono::duration<double>(o.timeout_s)) {
      rep.timed_out = true;
      stop_all();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return rep;
}

}  // namespace m3attn
