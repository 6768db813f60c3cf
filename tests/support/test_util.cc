#include "support/test_util.h"

#include <chrono>
#include <cstdlib>
#include <sstream>

namespace m3attn::testing {

uint64_t fresh_seed() {
  if (const char* env = std::getenv("M3ATTN_SEED")) return std::strtoull(env, nullptr, 10);
  static uint64_t counter = 0;
  const auto now = std::chrono::high_resolution_clock::now().time_since_epoch().count();
  return static_cast<uint64_t>(now) * 6364136223846793005ull + (++counter);
}

const std::vector<double>& e4m3_values() {
  static const std::vector<double> v = [] {
    std::vector<double> t(256);
    for (int c = 0; c < 256; ++c) t[c] = e4m3_to_float(static_cast<uint8_t>(c));
    return t;
  }();
  return v;
}

void fill_bf16_normal(Tensor& t, Rng& rng, float stddev) {
  uint16_t* p = t.ptr<uint16_t>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = float_to_bf16(rng.normal(0.0f, stddev));
}

void fill_bf16_integers(Tensor& t, Rng& rng, int lo, int hi) {
  uint16_t* p = t.ptr<uint16_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    p[i] = float_to_bf16(static_cast<float>(rng.integer(lo, hi)));
}

void fill_e4m3_normal(Tensor& t, Rng& rng, float stddev) {
  uint8_t* p = t.ptr<uint8_t>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = float_to_e4m3(rng.normal(0.0f, stddev));
}

void fill_e4m3_integers(Tensor& t, Rng& rng, int lo, int hi) {
  uint8_t* p = t.ptr<uint8_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    p[i] = float_to_e4m3(static_cast<float>(rng.integer(lo, hi)));
}

int64_t count_e4m3_mismatches(const uint8_t* a, const uint8_t* b, int64_t n, std::string* report) {
  int64_t bad = 0;
  std::ostringstream os;
  for (int64_t i = 0; i < n; ++i) {
    if (e4m3_within_one_step(a[i], b[i])) continue;
    if (bad < 8)
      os << "  [" << i << "] 0x" << std::hex << int{a[i]} << " (" << e4m3_to_float(a[i])
         << ") vs 0x" << int{b[i]} << " (" << e4m3_to_float(b[i]) << ")" << std::dec << "\n";
    ++bad;
  }
  if (report) *report = os.str();
  return bad;
}

}  // namespace m3attn::testing
