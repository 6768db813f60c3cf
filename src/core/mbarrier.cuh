// Shared-memory mbarrier wrappers (sm_90) for the kernels that pipeline bulk / TMA copies through a
// shared-memory ring. Barriers are passed as 32-bit shared-memory addresses.
#pragma once

#include <cstdint>

namespace m3attn::sm90 {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Arrives and announces `bytes` of asynchronous transactions the phase must also wait for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// kCluster: with cluster-scope acquire, for phases completed by arrivals from other CTAs of the
// cluster (mbarrier.arrive.release.cluster on a mapa address).
template <bool kCluster = false>
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  if constexpr (kCluster) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } else {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
  return done != 0;
}

// Waits for the phase of `parity` to complete. A wait of more than 2^34 clocks (seconds: a lost
// arrival or TMA transaction, a parity bug) traps, so a broken pipeline fails the launch instead of
// hanging the device.
template <bool kCluster = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_try_wait<kCluster>(bar, parity)) return;
  const long long start = clock64();
  while (!mbar_try_wait<kCluster>(bar, parity)) {
    if (clock64() - start > (1ll << 34)) __trap();
  }
}

}  // namespace m3attn::sm90
