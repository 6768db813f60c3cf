// Host collectives in one process (threads) and the NCCL entry points as far as a machine without
// GPUs can check them: a build without NCCL says so; a build with NCCL either opens the library or
// says why not, and never creates a communicator without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "dist/communicator.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using namespace m3attn::testing;  // NOLINT(build/namespaces)

TEST(ThreadHostCollectiveTest, SumMaxMinOverManyRounds) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  constexpr int kRanks = 4, kRounds = 200;
  std::vector<std::unique_ptr<HostCollective>> group = make_thread_host_collectives(kRanks);
  ASSERT_EQ(group.size(), static_cast<size_t>(kRanks));
  // values[round][rank][i], drawn up front so every thread can check every result.
  Rng rng(seed);
  std::vector<std::vector<std::vector<double>>> v(kRounds);
  for (auto& round : v) {
    round.resize(kRanks);
    for (auto& x : round) x = {static_cast<double>(rng.integer(-1000, 1000)), rng.normal()};
  }
  std::vector<int> errors(kRanks, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r]() {
      HostCollective& c = *group[static_cast<size_t>(r)];
      if (c.rank() != r || c.size() != kRanks) ++errors[static_cast<size_t>(r)];
      for (int k = 0; k < kRounds; ++k) {
        const CollectiveOp op = k % 3 == 0   ? CollectiveOp::kSum
                                : k % 3 == 1 ? CollectiveOp::kMax
                                             : CollectiveOp::kMin;
        std::vector<double> mine = v[static_cast<size_t>(k)][static_cast<size_t>(r)];
        if (!c.all_reduce(&mine, op).ok()) {
          ++errors[static_cast<size_t>(r)];
          continue;
        }
        for (size_t i = 0; i < 2; ++i) {
          double want = v[static_cast<size_t>(k)][0][i];
          for (int q = 1; q < kRanks; ++q) {
            const double x = v[static_cast<size_t>(k)][static_cast<size_t>(q)][i];
            want = op == CollectiveOp::kSum   ? want + x
                   : op == CollectiveOp::kMax ? std::max(want, x)
                                              : std::min(want, x);
          }
          if (mine[i] != want) ++errors[static_cast<size_t>(r)];
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], 0) << "rank " << r;
}

TEST(ThreadHostCollectiveTest, DifferentLengthsAreAnError) {
  std::vector<std::unique_ptr<HostCollective>> group = make_thread_host_collectives(2);
  Status s0, s1;
  std::thread t([&]() {
    std::vector<double> a = {1, 2};
    s1 = group[1]->all_reduce(&a, CollectiveOp::kSum);
  });
  std::vector<double> b = {1};
  s0 = group[0]->all_reduce(&b, CollectiveOp::kSum);
  t.join();
  EXPECT_FALSE(s0.ok());
  EXPECT_FALSE(s1.ok());
  EXPECT_TRUE(make_thread_host_collectives(0).empty());
  std::vector<std::unique_ptr<HostCollective>> one = make_thread_host_collectives(1);
  std::vector<double> x = {3, 4};
  ASSERT_TRUE(one[0]->all_reduce(&x, CollectiveOp::kMax).ok());
  EXPECT_EQ(x, (std::vector<double>{3, 4}));
}

TEST(NcclTest, AvailabilityIsReportedClearly) {
  std::string version;
  const Status s = nccl_available(&version);
  if (!nccl_built_in()) {
    EXPECT_EQ(s.code(), StatusCode::kUnsupported);
    EXPECT_NE(s.message().find("without NCCL"), std::string::npos) << s.to_string();
    Result<std::unique_ptr<Communicator>> c = Communicator::create(UniqueIdBytes{}, 2, 0, 0);
    EXPECT_EQ(c.status().code(), StatusCode::kUnsupported);
    EXPECT_EQ(Communicator::create_all({0, 1}).status().code(), StatusCode::kUnsupported);
    EXPECT_EQ(nccl_new_unique_id().status().code(), StatusCode::kUnsupported);
    EXPECT_EQ(make_nccl_host_collective(nullptr).status().code(), StatusCode::kUnsupported);
    return;
  }
  if (s.ok()) {
    EXPECT_EQ(version.substr(0, 2), "2.") << version;
    std::cout << "NCCL " << version << " opened\n";
  } else {
    EXPECT_EQ(s.code(), StatusCode::kUnsupported);
    EXPECT_NE(s.message().find("M3ATTN_NCCL_LIBRARY"), std::string::npos) << s.to_string();
  }
  // Bad arguments are rejected before NCCL or CUDA is touched.
  EXPECT_EQ(Communicator::create(UniqueIdBytes{}, 0, 0, 0).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Communicator::create(UniqueIdBytes{}, 2, 2, 0).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Communicator::create_all({}).status().code(), StatusCode::kInvalidArgument);
}

TEST(NcclTest, DtypeSizes) {
  EXPECT_EQ(collective_dtype_bytes(CollectiveDType::kBF16), 2);
  EXPECT_EQ(collective_dtype_bytes(CollectiveDType::kF32), 4);
  EXPECT_EQ(collective_dtype_bytes(CollectiveDType::kI32), 4);
  EXPECT_EQ(collective_dtype_bytes(CollectiveDType::kF64), 8);
}

}  // namespace
}  // namespace m3attn
