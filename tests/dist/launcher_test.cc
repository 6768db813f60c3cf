// The multi-GPU launcher without GPUs: unique-id encoding, the worker environment, rank-count
// validation, and process supervision with /bin/sh children (all succeed; one fails and the others
// are stopped; a child that ignores SIGTERM is killed; the time limit; exec failure; death by a
// signal).
#include "dist/launcher.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include "support/test_util.h"

namespace m3attn {
namespace {

using namespace m3attn::testing;  // NOLINT(build/namespaces)

UniqueIdBytes random_id(Rng& rng) {
  UniqueIdBytes id{};
  for (uint8_t& b : id) b = static_cast<uint8_t>(rng.integer(0, 255));
  return id;
}

TEST(UniqueIdTest, HexRoundTrip) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int i = 0; i < 20; ++i) {
    const UniqueIdBytes id = random_id(rng);
    const std::string hex = encode_unique_id(id);
    ASSERT_EQ(hex.size(), 256u);
    for (char c : hex) ASSERT_TRUE((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')) << hex;
    Result<UniqueIdBytes> back = decode_unique_id(hex);
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(back.value(), id);
    std::string upper = hex;
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    Result<UniqueIdBytes> up = decode_unique_id(upper);
    ASSERT_TRUE(up.ok());
    EXPECT_EQ(up.value(), id);
  }
  UniqueIdBytes edge{};
  edge[0] = 0x0f;
  edge[127] = 0xf0;
  EXPECT_EQ(encode_unique_id(edge).substr(0, 4), "0f00");
  EXPECT_EQ(encode_unique_id(edge).substr(252), "00f0");
}

TEST(UniqueIdTest, RejectsMalformedHex) {
  const std::string good(256, 'a');
  EXPECT_FALSE(decode_unique_id("").ok());
  EXPECT_FALSE(decode_unique_id(good.substr(1)).ok());
  EXPECT_FALSE(decode_unique_id(good + "0").ok());
  std::string bad = good;
  bad[77] = 'g';
  Result<UniqueIdBytes> r = decode_unique_id(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("77"), std::string::npos) << r.status().to_string();
}

TEST(DistRoleTest, LauncherWorkerAndErrors) {
  const std::string id(256, '3');
  std::map<std::string, std::string> env;
  EnvGetter get = [&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  Result<DistRole> none = dist_role_from_env(get);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none.value().worker);

  env = {{kEnvDistRank, "1"}, {kEnvDistSize, "2"}, {kEnvDistId, id}};
  Result<DistRole> w = dist_role_from_env(get);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_TRUE(w.value().worker);
  EXPECT_EQ(w.value().rank, 1);
  EXPECT_EQ(w.value().size, 2);
  EXPECT_EQ(w.value().id[5], 0x33);

  const std::map<std::string, std::string> bad[] = {
      {{kEnvDistRank, "1"}, {kEnvDistSize, "2"}},                       // id missing
      {{kEnvDistId, id}},                                               // rank, size missing
      {{kEnvDistRank, "2"}, {kEnvDistSize, "2"}, {kEnvDistId, id}},     // rank >= size
      {{kEnvDistRank, "-1"}, {kEnvDistSize, "2"}, {kEnvDistId, id}},    // negative rank
      {{kEnvDistRank, "0"}, {kEnvDistSize, "0"}, {kEnvDistId, id}},     // size 0
      {{kEnvDistRank, "0"}, {kEnvDistSize, "65"}, {kEnvDistId, id}},    // size > 64
      {{kEnvDistRank, "1x"}, {kEnvDistSize, "2"}, {kEnvDistId, id}},    // not a number
      {{kEnvDistRank, ""}, {kEnvDistSize, "2"}, {kEnvDistId, id}},      // empty
      {{kEnvDistRank, "0"}, {kEnvDistSize, "2"}, {kEnvDistId, "abc"}},  // short id
  };
  for (const auto& e : bad) {
    env = e;
    Result<DistRole> r = dist_role_from_env(get);
    EXPECT_FALSE(r.ok()) << "rank '" << (get(kEnvDistRank) ? get(kEnvDistRank) : "(unset)")
                         << "' size '" << (get(kEnvDistSize) ? get(kEnvDistSize) : "(unset)")
                         << "'";
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    }
  }
}

TEST(ValidateRanksTest, CountsAgainstDevices) {
  EXPECT_TRUE(validate_ranks(1, 1).ok());
  EXPECT_TRUE(validate_ranks(2, 2).ok());
  EXPECT_TRUE(validate_ranks(2, 8).ok());
  EXPECT_EQ(validate_ranks(0, 8).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(validate_ranks(65, 128).code(), StatusCode::kInvalidArgument);
  const Status few = validate_ranks(4, 2);
  EXPECT_EQ(few.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(few.message().find("4 ranks"), std::string::npos) << few.to_string();
  EXPECT_NE(few.message().find("has 2"), std::string::npos) << few.to_string();
  EXPECT_EQ(validate_ranks(1, 0).code(), StatusCode::kResourceExhausted);
}

TEST(ForceNvlsOffTest, OverwritesTheVariable) {
  setenv("NCCL_NVLS_ENABLE", "1", 1);
  force_nvls_off();
  ASSERT_NE(std::getenv("NCCL_NVLS_ENABLE"), nullptr);
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
}

LaunchOptions sh(const std::string& script, int ranks) {
  LaunchOptions o;
  o.argv = {"/bin/sh", "-c", script};
  o.ranks = ranks;
  o.timeout_s = 60;
  o.grace_s = 2;
  return o;
}

std::string temp_dir() {
  char tmpl[] = "/tmp/m3attn_launcher_XXXXXX";
  const char* d = mkdtemp(tmpl);
  return d ? d : "";
}

TEST(LaunchRanksTest, EveryRankGetsItsEnvironment) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  LaunchOptions o =
      sh("printf '%s %s %s %s' \"$M3ATTN_DIST_RANK\" \"$M3ATTN_DIST_SIZE\" \"$NCCL_NVLS_ENABLE\" "
         "\"$M3ATTN_DIST_ID\" > \"$OUT_DIR/rank_$M3ATTN_DIST_RANK\"",
         3);
  o.id = random_id(rng);
  o.extra_env = {{"OUT_DIR", dir}};
  setenv("NCCL_NVLS_ENABLE", "1", 1);  // the parent's value must not leak into the children
  Result<LaunchReport> rep = launch_ranks(o);
  force_nvls_off();
  ASSERT_TRUE(rep.ok()) << rep.status().to_string();
  EXPECT_TRUE(rep.value().ok()) << rep.value().summary();
  ASSERT_EQ(rep.value().ranks.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(rep.value().ranks[static_cast<size_t>(r)].exit_code, 0);
    std::ifstream f(dir + "/rank_" + std::to_string(r));
    std::string rank, size, nvls, id;
    f >> rank >> size >> nvls >> id;
    EXPECT_EQ(rank, std::to_string(r));
    EXPECT_EQ(size, "3");
    EXPECT_EQ(nvls, "0");
    EXPECT_EQ(id, encode_unique_id(o.id));
    std::remove((dir + "/rank_" + std::to_string(r)).c_str());
  }
  rmdir(dir.c_str());
}

TEST(LaunchRanksTest, FailingRankIsReportedAndOthersStopped) {
  const auto start = std::chrono::steady_clock::now();
  Result<LaunchReport> rep =
      launch_ranks(sh("if [ \"$M3ATTN_DIST_RANK\" = 1 ]; then exit 3; fi; exec sleep 30", 3));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(rep.ok()) << rep.status().to_string();
  const LaunchReport& r = rep.value();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.first_failed, 1);
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.ranks[1].exit_code, 3);
  EXPECT_FALSE(r.ranks[1].stopped_by_launcher);
  for (int k : {0, 2}) {
    EXPECT_TRUE(r.ranks[static_cast<size_t>(k)].stopped_by_launcher);
    EXPECT_EQ(r.ranks[static_cast<size_t>(k)].signal, SIGTERM);
  }
  EXPECT_LT(s, 20.0) << "the sleeping ranks were not stopped";
  EXPECT_NE(r.summary().find("rank 1 failed first"), std::string::npos) << r.summary();
  EXPECT_NE(r.summary().find("exited with code 3"), std::string::npos) << r.summary();
}

TEST(LaunchRanksTest, RankIgnoringSigtermIsKilled) {
  // Rank 1 ignores SIGTERM and then says so through a file; rank 0 fails once it sees the file.
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  LaunchOptions o =
      sh("if [ \"$M3ATTN_DIST_RANK\" = 0 ]; then "
         "while [ ! -e \"$OUT_DIR/trapped\" ]; do sleep 0.05; done; exit 4; fi; "
         "trap '' TERM; : > \"$OUT_DIR/trapped\"; "
         "i=0; while [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done",
         2);
  o.extra_env = {{"OUT_DIR", dir}};
  o.grace_s = 0.5;
  Result<LaunchReport> rep = launch_ranks(o);
  std::remove((dir + "/trapped").c_str());
  rmdir(dir.c_str());
  ASSERT_TRUE(rep.ok());
  EXPECT_EQ(rep.value().first_failed, 0);
  EXPECT_EQ(rep.value().ranks[1].signal, SIGKILL) << rep.value().summary();
}

TEST(LaunchRanksTest, TimeLimitStopsEveryRank) {
  LaunchOptions o = sh("exec sleep 30", 2);
  o.timeout_s = 0.5;
  Result<LaunchReport> rep = launch_ranks(o);
  ASSERT_TRUE(rep.ok());
  EXPECT_TRUE(rep.value().timed_out);
  EXPECT_EQ(rep.value().first_failed, -1);
  EXPECT_FALSE(rep.value().ok());
  for (const RankExit& e : rep.value().ranks) EXPECT_TRUE(e.stopped_by_launcher);
  EXPECT_NE(rep.value().summary().find("time limit"), std::string::npos);
}

TEST(LaunchRanksTest, ExecFailureAndSignalDeath) {
  LaunchOptions o;
  o.argv = {"/nonexistent/m3attn"};
  o.ranks = 2;
  Result<LaunchReport> rep = launch_ranks(o);
  ASSERT_TRUE(rep.ok());
  EXPECT_FALSE(rep.value().ok());
  EXPECT_GE(rep.value().first_failed, 0);
  EXPECT_EQ(rep.value().ranks[static_cast<size_t>(rep.value().first_failed)].exit_code, 127);

  Result<LaunchReport> sig = launch_ranks(sh("kill -SEGV $$", 1));
  ASSERT_TRUE(sig.ok());
  EXPECT_EQ(sig.value().first_failed, 0);
  EXPECT_EQ(sig.value().ranks[0].signal, SIGSEGV) << sig.value().summary();
}

TEST(LaunchRanksTest, RejectsBadOptions) {
  LaunchOptions o;
  EXPECT_EQ(launch_ranks(o).status().code(), StatusCode::kInvalidArgument) << "empty argv";
  o = sh("true", 0);
  EXPECT_EQ(launch_ranks(o).status().code(), StatusCode::kInvalidArgument) << "0 ranks";
  o = sh("true", 65);
  EXPECT_EQ(launch_ranks(o).status().code(), StatusCode::kInvalidArgument) << "65 ranks";
  o = sh("true", 1);
  o.extra_env = {{"NCCL_NVLS_ENABLE", "1"}};
  EXPECT_EQ(launch_ranks(o).status().code(), StatusCode::kInvalidArgument)
      << "NVLink multicast must stay off";
  o.extra_env = {{"A=B", "1"}};
  EXPECT_EQ(launch_ranks(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(SelfTest, ExecutableAndCommandLine) {
  Result<std::string> exe = self_executable();
  ASSERT_TRUE(exe.ok()) << exe.status().to_string();
  EXPECT_EQ(access(exe.value().c_str(), X_OK), 0) << exe.value();
  Result<std::vector<std::string>> args = self_command_line();
  ASSERT_TRUE(args.ok()) << args.status().to_string();
  ASSERT_FALSE(args.value().empty());
  EXPECT_NE(args.value()[0].find("test_dist"), std::string::npos) << args.value()[0];
}

}  // namespace
}  // namespace m3attn
