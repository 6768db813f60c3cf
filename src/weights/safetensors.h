// Safetensors reading and writing (single files and sharded checkpoints).
//
// File layout: u64 little-endian header length N, N bytes of JSON header, then the data region.
// The header maps tensor name -> {"dtype", "shape", "data_offsets": [begin, end)} (offsets relative
// to the data region) plus an optional "__metadata__" string -> string map.
//
// Supported dtypes: "BF16", "F32", "I32", "F8_E4M3" and "F8_E8M0" (DType kBF16, kF32, kI32, kE4M3,
// kE8M0). The other standard safetensors dtypes (BOOL, U8, I8, F8_E5M2, I16, U16, F16, U32, F64,
// I64, U64) are parsed and checked like the rest, so that a checkpoint holding such tensors still
// opens, but view() and read() of them fail with kUnsupported naming the tensor and the dtype
// (bytes() still gives their raw data). A dtype string that is not a safetensors dtype at all
// fails the open (kUnsupported, naming the tensor and the dtype).
//
// Every rule of the format is checked when a file is opened (sizes, offsets in bounds and not
// overlapping, byte size == numel * dtype size, shapes non-negative without overflow, no duplicate
// names); a truncated or inconsistent file is a kDataLoss Status, never a crash or a read past the
// end of the mapping. Headers above 100 MB are refused (as the reference implementation does).
// Files are memory-mapped read-only.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "m3attn/tensor.h"

namespace m3attn {

// "BF16" <-> DType::kBF16, ... ; unknown strings are kUnsupported naming the string.
Result<DType> safetensors_dtype_from_string(const std::string& dtype);
const char* safetensors_dtype_string(DType dtype);

struct SafetensorsEntry {
  std::string name;
  std::string dtype_string;   // as in the header: "BF16", "F8_E4M3", "U8", ...
  bool supported = true;      // dtype_string maps to a DType
  DType dtype = DType::kF32;  // meaningful only when supported
  int element_size = 0;       // bytes per element of dtype_string
  std::vector<int64_t> shape;
  int64_t offset = 0;  // absolute byte offset of the data inside the file (8 + header + begin)
  int64_t size = 0;    // bytes (== numel * dtype_size)

  int64_t numel() const;
  std::string shape_string() const;  // "[4, 128]"
};

class SafetensorsFile {
 public:
  SafetensorsFile() = default;

  // Memory-maps `path` read-only and validates the whole header.
  static Result<SafetensorsFile> open(const std::string& path);
  // Parses an in-memory image (tests, fuzzing); the bytes are kept by the returned object.
  static Result<SafetensorsFile> from_bytes(std::vector<uint8_t> bytes,
                                            const std::string& name = "<memory>");

  const std::string& path() const { return path_; }
  // Entries in data order (ascending offset).
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const SafetensorsEntry* find(const std::string& name) const;
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  int64_t file_size() const;

  // Contiguous CPU view into the mapping. The memory is read-only: never write through it. The
  // view stays valid while this object (or a copy of it) is alive. kInvalidArgument when the
  // tensor does not exist, kUnsupported when it has more than kMaxDims dimensions or its data is
  // not aligned to its element size (files from standard writers always are; read() still works).
  Result<TensorView> view(const std::string& name) const;
  // An owning copy of the tensor.
  Result<Tensor> read(const std::string& name) const;
  // Raw bytes of a tensor, any dtype (nullptr when `entry` is not an entry of this file).
  const uint8_t* bytes(const SafetensorsEntry& entry) const;

 private:
  struct Mapping;
  static Result<SafetensorsFile> parse(std::shared_ptr<Mapping> mapping, const std::string& name);

  std::string path_;
  std::shared_ptr<Mapping> mapping_;  // shared: copies of a SafetensorsFile share one mapping
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

using NamedTensor = std::pair<std::string, TensorView>;

// Serializes CPU tensors (any strides) in the given order; the header is padded with spaces to a
// multiple of 8 bytes so that the data region is 8-byte aligned. Rejects duplicate or empty names,
// names starting with "__", device views and views without data.
Result<std::vector<uint8_t>> encode_safetensors(
    const std::vector<NamedTensor>& tensors,
    const std::map<std::string, std::string>& metadata = {});
Status write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

// A checkpoint: one .safetensors file, or shards listed by `model.safetensors.index.json`
// ({"weight_map": {tensor name: shard file name}}).
class Checkpoint {
 public:
  Checkpoint() = default;

  // `path` may be a .safetensors file, an index .json file, or a directory holding
  // model.safetensors.index.json or else exactly one *.safetensors file (model.safetensors is
  // preferred). All shards are mapped and every weight_map entry must exist in its shard.
  static Result<Checkpoint> open(const std::string& path);
  // A checkpoint over already opened files (tests); names must be unique across files.
  static Result<Checkpoint> from_files(std::vector<SafetensorsFile> files);

  const std::string& directory() const { return directory_; }
  size_t num_files() const { return files_.size(); }
  const SafetensorsFile& file(size_t i) const { return files_[i]; }

  const SafetensorsEntry* find(const std::string& name) const;
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  // The file holding `name` (nullptr when absent).
  const SafetensorsFile* file_of(const std::string& name) const;
  Result<TensorView> view(const std::string& name) const;
  Result<Tensor> read(const std::string& name) const;
  std::vector<std::string> tensor_names() const;  // sorted

 private:
  std::string directory_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index into files_
};

}  // namespace m3attn
