// Starting the ranks of a multi-GPU run: one process per GPU, no mpirun.
//
// The launcher (the `m3attn tp` command in its parent role) makes an NCCL unique id, then forks and
// execs the same binary with the same arguments once per rank, with three environment variables:
//   M3ATTN_DIST_RANK  the rank r (0-based)        M3ATTN_DIST_SIZE  the number of ranks P
//   M3ATTN_DIST_ID    the unique id, 256 lowercase hex digits (128 bytes)
// plus NCCL_NVLS_ENABLE=0 (NVLink multicast stays off in every process). A process that finds the
// three variables is a worker: it sets CUDA device r and joins the communicator.
//
// Supervision: the launcher polls its children. The first child that exits non-zero or dies from a
// signal is reported by rank; the others are sent SIGTERM, then SIGKILL after a grace period, so a
// rank blocked in a collective whose peer died never hangs the run. A run past its time limit is
// ended the same way. Only the children it started are signalled, by pid.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "m3attn/status.h"

namespace m3attn {

constexpr int kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
using UniqueIdBytes = std::array<uint8_t, kUniqueIdBytes>;

constexpr const char* kEnvDistRank = "M3ATTN_DIST_RANK";
constexpr const char* kEnvDistSize = "M3ATTN_DIST_SIZE";
constexpr const char* kEnvDistId = "M3ATTN_DIST_ID";
constexpr int kMaxRanks = 64;

// 256 lowercase hex digits.
std::string encode_unique_id(const UniqueIdBytes& id);
// Exactly 256 hex digits (either case); invalid_argument naming the offending character otherwise.
Result<UniqueIdBytes> decode_unique_id(const std::string& hex);

// Sets NCCL_NVLS_ENABLE=0 in this process's environment (overwriting any other value), so that it
// and every child it starts keep NVLink multicast off.
void force_nvls_off();

// What this process is: a worker (the three variables set and valid) or the launcher (none set).
struct DistRole {
  bool worker = false;
  int rank = 0;
  int size = 1;
  UniqueIdBytes id{};
};
using EnvGetter = std::function<const char*(const char*)>;
// Reads the variables through `getenv` (std::getenv when empty). invalid_argument when only some
// are set, a number does not parse, size is outside [1, kMaxRanks], rank outside [0, size) or the
// id is malformed.
Result<DistRole> dist_role_from_env(const EnvGetter& getenv = {});

// The run's rank count against the devices present: ranks in [1, kMaxRanks] (invalid_argument),
// ranks <= device_count (resource_exhausted naming both numbers).
Status validate_ranks(int ranks, int device_count);

struct LaunchOptions {
  std::vector<std::string> argv;  // argv[0] is the program path (execv, no PATH search)
  int ranks = 1;
  UniqueIdBytes id{};
  double timeout_s = 600;                                      // the whole run; <= 0: no limit
  double grace_s = 5;                                          // SIGTERM -> SIGKILL
  std::vector<std::pair<std::string, std::string>> extra_env;  // set in every child
};

struct RankExit {
  int rank = 0;
  int pid = 0;
  int exit_code = -1;  // when it exited
  int signal = 0;      // when a signal ended it
  bool stopped_by_launcher = false;
};

struct LaunchReport {
  std::vector<RankExit> ranks;  // by rank
  int first_failed = -1;        // the rank whose failure ended the run (-1: none)
  bool timed_out = false;
  bool ok() const { return first_failed < 0 && !timed_out; }
  // One line per rank that did not exit 0, plus the cause ("rank 1 exited with code 3; ...").
  std::string summary() const;
};

// Starts options.ranks children and waits for all of them (see the file comment). invalid_argument
// for bad options (nothing started); a failed fork stops the ranks already started.
Result<LaunchReport> launch_ranks(const LaunchOptions& options);

// The path of the running executable (/proc/self/exe), for re-executing it.
Result<std::string> self_executable();
// This process's command line as it was started (/proc/self/cmdline).
Result<std::vector<std::string>> self_command_line();
// CUDA devices this process sees (0 without the CUDA backend or without a driver).
int visible_cuda_devices();

}  // namespace m3attn
