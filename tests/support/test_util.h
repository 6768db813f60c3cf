// Test helpers: seeded random inputs (the seed is printed so a failure can be replayed), poisoned
// buffers and E4M3 comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "m3attn/tensor.h"

namespace m3attn::testing {

// A fresh seed per call unless M3ATTN_SEED is set; printed through a gtest trace.
uint64_t fresh_seed();

class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  float normal(float mean = 0.0f, float stddev = 1.0f) {
    return std::normal_distribution<float>(mean, stddev)(gen_);
  }
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen_); }
  int64_t integer(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen_);
  }
  std::mt19937_64& engine() { return gen_; }

 private:
  std::mt19937_64 gen_;
};

// Fill helpers (host tensors).
void fill_bf16_normal(Tensor& t, Rng& rng, float stddev = 1.0f);
void fill_bf16_integers(Tensor& t, Rng& rng, int lo, int hi);
void fill_e4m3_normal(Tensor& t, Rng& rng, float stddev = 1.0f);
void fill_e4m3_integers(Tensor& t, Rng& rng, int lo, int hi);

// The 256 E4M3 codes decoded to double (reference dot products index it by the code).
const std::vector<double>& e4m3_values();

// Counts E4M3 elements of a and b that are not within one step (NaN counts as a mismatch); the
// first few offenders are described in `report`.
int64_t count_e4m3_mismatches(const uint8_t* a, const uint8_t* b, int64_t n, std::string* report);

}  // namespace m3attn::testing

// Records the seed in every failure message of the enclosing scope.
#define M3_SEED_TRACE(seed) SCOPED_TRACE(::testing::Message() << "seed " << (seed))
