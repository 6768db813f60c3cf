// Helpers shared by the weights tests: scratch directories and hand-built safetensors images.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "m3attn/tensor.h"

namespace m3attn::weights_test {

// Writes element i of a host tensor. Out of line: with a constant index GCC's
// -Wstringop-overflow mistakes a write into Tensor storage for one past its first 64-byte chunk.
template <typename T>
[[gnu::noinline]] void poke(Tensor& t, int64_t i, T v) {
  t.ptr<T>()[i] = v;
}

// A fresh directory under the system temp folder, removed with everything in it at scope exit.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag) {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("m3attn_" + tag + "_" + std::to_string(::getpid()) + "_" +
             std::to_string(counter.fetch_add(1)));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::string path() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  void write_text(const std::string& name, const std::string& text) const {
    std::ofstream out(path_ / name, std::ios::binary);
    out << text;
  }

 private:
  std::filesystem::path path_;
};

// A safetensors image: 8-byte little-endian header length (`header.size()` unless overridden),
// the header text, then `data_bytes` zero bytes.
inline std::vector<uint8_t> st_image(const std::string& header, size_t data_bytes,
                                     uint64_t header_len = UINT64_MAX - 1) {
  const uint64_t len = header_len == UINT64_MAX - 1 ? header.size() : header_len;
  std::vector<uint8_t> out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(len >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.resize(out.size() + data_bytes, 0);
  return out;
}

}  // namespace m3attn::weights_test
