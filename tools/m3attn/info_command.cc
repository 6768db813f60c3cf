// `m3attn info`: what this build can do (backends, geometry, devices).
#include <iostream>

#include "commands.h"
#include "m3attn/config.h"

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace m3attn::cli {

void add_info_command(CLI::App& app, int& exit_code) {
  CLI::App* cmd = app.add_subcommand("info", "Show the build's backends and the M3 geometry");
  cmd->callback([&exit_code]() {
    const MsaGeometry g = MsaGeometry::m3();
    std::cout << "m3attn 0.1.0\n";
    std::cout << "M3 attention layer: " << g.to_string() << "\n";
#if defined(M3ATTN_WITH_CUDA)
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    std::cout << "backends: cpu, cuda (sm_90a)\n";
    if (err != cudaSuccess) {
      std::cout << "cuda devices: none (" << cudaGetErrorString(err) << ")\n";
    } else {
      for (int i = 0; i < count; ++i) {
        cudaDeviceProp prop{};
        if (cudaGetDeviceProperties(&prop, i) == cudaSuccess)
          std::cout << "cuda:" << i << " " << prop.name << ", sm_" << prop.major << prop.minor
                    << ", " << prop.multiProcessorCount << " SMs\n";
      }
    }
#else
    std::cout << "backends: cpu (built without CUDA)\n";
#endif
    exit_code = 0;
  });
}

}  // namespace m3attn::cli
