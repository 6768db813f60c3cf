#include "weights/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "support/test_util.h"
#include "weights/weights_test_util.h"

namespace m3attn {
namespace {

using testing::fresh_seed;
using testing::Rng;
using weights_test::ScratchDir;
using weights_test::st_image;
namespace fs = std::filesystem;

Tensor random_bytes_tensor(DType dtype, std::vector<int64_t> shape, Rng& rng) {
  Tensor t(dtype, std::move(shape));
  auto* p = t.ptr<uint8_t>();
  for (int64_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<uint8_t>(rng.integer(0, 255));
  return t;
}

TEST(Safetensors, DTypeNames) {
  for (DType d : {DType::kBF16, DType::kF32, DType::kI32, DType::kE4M3, DType::kE8M0}) {
    auto back = safetensors_dtype_from_string(safetensors_dtype_string(d));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(back.value(), d);
  }
  auto bad = safetensors_dtype_from_string("F16");
  EXPECT_EQ(bad.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(bad.status().message().find("\"F16\""), std::string::npos);
}

TEST(Safetensors, RoundTripThroughFile) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // Odd sizes so that the writer's dtype ordering is what keeps every tensor aligned.
  Tensor e4 = random_bytes_tensor(DType::kE4M3, {3, 5}, rng);
  Tensor bf = random_bytes_tensor(DType::kBF16, {7}, rng);
  Tensor f = random_bytes_tensor(DType::kF32, {2, 3, 1}, rng);
  Tensor i = random_bytes_tensor(DType::kI32, {1}, rng);
  Tensor s = random_bytes_tensor(DType::kE8M0, {4, 1}, rng);
  Tensor empty(DType::kF32, {0, 4});
  // A strided (transposed) view: written in logical row-major order.
  Tensor base = random_bytes_tensor(DType::kF32, {4, 6}, rng);
  TensorView transposed = TensorView::strided(base.data(), DType::kF32, {6, 4}, {1, 6});

  ScratchDir dir("st_roundtrip");
  const std::string path = dir.file("a.safetensors");
  ASSERT_TRUE(write_safetensors(path,
                                {{"e4", e4.view()},
                                 {"bf", bf.view()},
                                 {"f", f.view()},
                                 {"i", i.view()},
                                 {"scale", s.view()},
                                 {"empty", empty.view()},
                                 {"t", transposed}},
                                {{"format", "pt"}, {"note", "h1"}})
                  .ok());

  auto opened = SafetensorsFile::open(path);
  ASSERT_TRUE(opened.ok()) << opened.status().to_string();
  const SafetensorsFile& file = opened.value();
  EXPECT_EQ(file.entries().size(), 7u);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.metadata().at("note"), "h1");

  // The header is padded with spaces so that the data region is 8-byte aligned.
  std::ifstream in(path, std::ios::binary);
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t header_len = 0;
  std::memcpy(&header_len, raw.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(static_cast<int64_t>(raw.size()), file.file_size());

  auto check = [&](const char* name, const Tensor& want) {
    SCOPED_TRACE(name);
    const SafetensorsEntry* e = file.find(name);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->dtype, want.dtype());
    EXPECT_EQ(e->shape, want.shape());
    EXPECT_EQ(e->size, want.nbytes());
    auto v = file.view(name);
    ASSERT_TRUE(v.ok()) << v.status().to_string();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.value().data) % dtype_size(want.dtype()), 0u);
    auto r = file.read(name);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r.value().shape(), want.shape());
    if (want.nbytes() == 0) return;  // memcmp must not see the null buffer of an empty tensor
    EXPECT_EQ(std::memcmp(v.value().data, want.data(), want.nbytes()), 0);
    EXPECT_EQ(std::memcmp(r.value().data(), want.data(), want.nbytes()), 0);
  };
  check("e4", e4);
  check("bf", bf);
  check("f", f);
  check("i", i);
  check("scale", s);
  check("empty", empty);
  Tensor t_want(DType::kF32, {6, 4});
  for (int r = 0; r < 6; ++r)
    for (int c = 0; c < 4; ++c) t_want.ptr<float>()[r * 4 + c] = base.ptr<float>()[c * 6 + r];
  check("t", t_want);

  EXPECT_EQ(file.find("missing"), nullptr);
  EXPECT_EQ(file.view("missing").status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(file.read("missing").status().message().find("missing"), std::string::npos);
}

TEST(Safetensors, EncodeRejectsBadInput) {
  Tensor a(DType::kF32, {2});
  a.fill_bytes(0);
  auto expect_reject = [](const std::vector<NamedTensor>& ts, const char* needle) {
    auto r = encode_safetensors(ts);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  expect_reject({{"x", a.view()}, {"x", a.view()}}, "given twice");
  expect_reject({{"", a.view()}}, "must not be empty");
  expect_reject({{"__metadata__", a.view()}}, "reserved");
  TensorView on_gpu = a.view();
  on_gpu.device = Device::cuda(0);
  expect_reject({{"g", on_gpu}}, "only host tensors");
  TensorView no_data = a.view();
  no_data.data = nullptr;
  expect_reject({{"n", no_data}}, "has no data");
  auto bad_utf8 = encode_safetensors({{std::string("\xff\xfe"), a.view()}});
  EXPECT_FALSE(bad_utf8.ok());
  EXPECT_NE(bad_utf8.status().message().find("UTF-8"), std::string::npos);
}

// Each malformed image is rejected with the expected code and a message naming the problem.
struct Malformed {
  const char* what;
  std::vector<uint8_t> bytes;
  StatusCode code;
  const char* needle;
};

TEST(Safetensors, MalformedCorpusIsRejected) {
  const std::string ok_entry = R"("w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})";
  std::vector<Malformed> corpus = {
      {"empty file", {}, StatusCode::kDataLoss, "shorter than the 8-byte"},
      {"7 bytes", std::vector<uint8_t>(7, 0), StatusCode::kDataLoss, "shorter than the 8-byte"},
      {"header length past the end", st_image("{}", 0, 100), StatusCode::kDataLoss,
       "runs past the end"},
      {"huge header length", st_image("{}", 0, ~uint64_t{0}), StatusCode::kDataLoss,
       "runs past the end"},
      {"invalid json", st_image("{\"w\":", 0), StatusCode::kDataLoss, "not valid JSON"},
      {"json array", st_image("[1,2]", 0), StatusCode::kDataLoss, "must be a JSON object"},
      {"entry not object", st_image(R"({"w":3})", 0), StatusCode::kDataLoss,
       "\"w\" must be described by an object"},
      {"missing dtype", st_image(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", 4),
       StatusCode::kDataLoss, "\"w\" has no \"dtype\""},
      {"missing shape", st_image(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", 4),
       StatusCode::kDataLoss, "\"w\" has no \"shape\""},
      {"missing offsets", st_image(R"({"w":{"dtype":"F32","shape":[1]}})", 4),
       StatusCode::kDataLoss, "\"w\" has no \"data_offsets\""},
      {"dtype not a string", st_image(R"({"w":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", 4),
       StatusCode::kDataLoss, "dtype must be a string"},
      {"unknown dtype", st_image(R"({"w":{"dtype":"F99","shape":[1],"data_offsets":[0,8]}})", 8),
       StatusCode::kUnsupported, "\"w\" has dtype \"F99\", which is not a safetensors dtype"},
      {"foreign dtype size mismatch",
       st_image(R"({"w":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}})", 8),
       StatusCode::kDataLoss, "shape [2] of F64 needs 16"},
      {"shape not array", st_image(R"({"w":{"dtype":"F32","shape":4,"data_offsets":[0,16]}})", 16),
       StatusCode::kDataLoss, "shape must be an array"},
      {"negative shape",
       st_image(R"({"w":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,16]}})", 16),
       StatusCode::kDataLoss, "not a non-negative integer"},
      {"fractional shape",
       st_image(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,16]}})", 16),
       StatusCode::kDataLoss, "not a non-negative integer"},
      {"shape overflow",
       st_image(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,16]}})",
                16),
       StatusCode::kDataLoss, "overflows 64-bit element counts"},
      {"byte count overflow",
       st_image(R"({"w":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,16]}})", 16),
       StatusCode::kDataLoss, "overflows 64-bit byte counts"},
      {"offsets not a pair",
       st_image(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", 8),
       StatusCode::kDataLoss, "must be two non-negative integers"},
      {"negative offset", st_image(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", 8),
       StatusCode::kDataLoss, "must be two non-negative integers"},
      {"offset beyond int64",
       st_image(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]}})", 8),
       StatusCode::kDataLoss, "must be two non-negative integers"},
      {"reversed offsets", st_image(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8),
       StatusCode::kDataLoss, "are reversed"},
      {"offsets out of bounds",
       st_image(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 12),
       StatusCode::kDataLoss, "run past the data region of 12 bytes"},
      {"size mismatch", st_image(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", 16),
       StatusCode::kDataLoss, "occupies 16 bytes but shape [3] of F32 needs 12"},
      {"overlap",
       st_image("{" + ok_entry + R"(,"v":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})", 20),
       StatusCode::kDataLoss, "overlap"},
      {"duplicate name", st_image("{" + ok_entry + "," + ok_entry + "}", 16), StatusCode::kDataLoss,
       "\"w\" appears twice"},
      {"metadata not object", st_image(R"({"__metadata__":[1]})", 0), StatusCode::kDataLoss,
       "__metadata__ must be an object"},
      {"metadata value not string", st_image(R"({"__metadata__":{"a":1}})", 0),
       StatusCode::kDataLoss, "__metadata__ value of \"a\" must be a string"},
  };
  for (const Malformed& m : corpus) {
    SCOPED_TRACE(m.what);
    auto r = SafetensorsFile::from_bytes(m.bytes, "corpus");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), m.code) << r.status().to_string();
    EXPECT_NE(r.status().message().find(m.needle), std::string::npos) << r.status().to_string();
  }
  // Controls: the well-formed versions parse.
  EXPECT_TRUE(SafetensorsFile::from_bytes(st_image("{" + ok_entry + "}", 16)).ok());
  EXPECT_TRUE(SafetensorsFile::from_bytes(st_image("{}", 0)).ok());
  auto zero = SafetensorsFile::from_bytes(st_image(
      R"({"z":{"dtype":"BF16","shape":[0,3],"data_offsets":[0,0]},)" + ok_entry + "}", 16));
  ASSERT_TRUE(zero.ok()) << zero.status().to_string();
  EXPECT_EQ(zero.value().find("z")->size, 0);
}

TEST(Safetensors, ForeignDTypesOpenButCannotBeViewed) {
  // A checkpoint may hold tensors of dtypes m3attn does not compute with; the file still opens,
  // their raw bytes are reachable, and view/read name the tensor and the dtype.
  std::vector<uint8_t> image = st_image(R"({"h":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},)"
                                        R"("u":{"dtype":"U8","shape":[3],"data_offsets":[4,7]},)"
                                        R"("w":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                                        12);
  image[image.size() - 12 + 4] = 0xab;
  auto f = SafetensorsFile::from_bytes(image, "mixed");
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  const SafetensorsEntry* u = f.value().find("u");
  ASSERT_NE(u, nullptr);
  EXPECT_FALSE(u->supported);
  EXPECT_EQ(u->dtype_string, "U8");
  EXPECT_EQ(u->size, 3);
  ASSERT_NE(f.value().bytes(*u), nullptr);
  EXPECT_EQ(f.value().bytes(*u)[0], 0xab);
  for (const char* name : {"h", "u"}) {
    auto v = f.value().view(name);
    EXPECT_EQ(v.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(v.status().message().find("\"" + std::string(name) + "\" has dtype"),
              std::string::npos)
        << v.status().to_string();
    EXPECT_EQ(f.value().read(name).status().code(), StatusCode::kUnsupported);
  }
  EXPECT_TRUE(f.value().find("w")->supported);
  EXPECT_TRUE(f.value().view("w").ok());
}

TEST(Safetensors, EveryTruncationIsDataLoss) {
  Tensor a(DType::kF32, {3, 3});
  Tensor b(DType::kBF16, {5});
  a.fill_bytes(0x11);
  b.fill_bytes(0x22);
  auto image = encode_safetensors({{"a", a.view()}, {"b", b.view()}}, {{"k", "v"}});
  ASSERT_TRUE(image.ok());
  const auto& full = image.value();
  ASSERT_TRUE(SafetensorsFile::from_bytes(full).ok());
  for (size_t n = 0; n < full.size(); ++n) {
    std::vector<uint8_t> cut(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    auto r = SafetensorsFile::from_bytes(std::move(cut));
    ASSERT_FALSE(r.ok()) << "truncated to " << n << " of " << full.size() << " bytes";
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().to_string();
  }
}

TEST(Safetensors, RandomCorruptionNeverCrashes) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  Tensor a(DType::kF32, {4, 4});
  a.fill_bytes(0);
  auto image = encode_safetensors({{"a", a.view()}, {"bb", a.view()}});
  ASSERT_TRUE(image.ok());
  int rejected = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint8_t> bytes = image.value();
    const int flips = static_cast<int>(rng.integer(1, 4));
    for (int f = 0; f < flips; ++f) {
      // Mostly inside the 8-byte length and the header, where parsing happens.
      const size_t at = static_cast<size_t>(rng.integer(0, 8 + 96));
      bytes[std::min(at, bytes.size() - 1)] = static_cast<uint8_t>(rng.integer(0, 255));
    }
    auto r = SafetensorsFile::from_bytes(std::move(bytes));
    if (!r.ok()) {
      ++rejected;
      continue;
    }
    // Whatever was accepted must lie inside the image and be readable, except an entry whose
    // dtype became a standard safetensors dtype m3attn does not support (e.g. F32 -> U32): such
    // files open and refuse the read (ForeignDTypesOpenButCannotBeViewed).
    for (const SafetensorsEntry& e : r.value().entries()) {
      ASSERT_GE(e.offset, 8);
      ASSERT_LE(e.offset + e.size, r.value().file_size());
      Result<Tensor> t = r.value().read(e.name);
      if (e.supported) {
        ASSERT_TRUE(t.ok()) << t.status().to_string();
      } else {
        ASSERT_EQ(t.status().code(), StatusCode::kUnsupported) << e.dtype_string;
      }
    }
  }
  EXPECT_GT(rejected, 0);
}

TEST(Safetensors, OpenMissingFileIsIoError) {
  ScratchDir dir("st_missing");
  auto r = SafetensorsFile::open(dir.file("nope.safetensors"));
  EXPECT_EQ(r.status().code(), StatusCode::kIoError);
  EXPECT_NE(r.status().message().find("nope.safetensors"), std::string::npos);
  auto d = SafetensorsFile::open(dir.path());
  EXPECT_FALSE(d.ok());
}

TEST(Checkpoint, ShardedIndexFindsTensorsAcrossFiles) {
  ScratchDir dir("ckpt_sharded");
  Tensor a(DType::kF32, {2, 2});
  Tensor b(DType::kBF16, {3});
  Tensor c(DType::kE4M3, {5});
  a.fill_bytes(1);
  b.fill_bytes(2);
  c.fill_bytes(3);
  ASSERT_TRUE(write_safetensors(dir.file("s1.safetensors"), {{"a", a.view()}}).ok());
  ASSERT_TRUE(
      write_safetensors(dir.file("s2.safetensors"), {{"b", b.view()}, {"c", c.view()}}).ok());
  dir.write_text("model.safetensors.index.json",
                 R"({"metadata":{"total_size":24},"weight_map":{"a":"s1.safetensors",)"
                 R"("b":"s2.safetensors","c":"s2.safetensors"}})");
  for (const std::string& p : {dir.path(), dir.file("model.safetensors.index.json")}) {
    SCOPED_TRACE(p);
    auto ck = Checkpoint::open(p);
    ASSERT_TRUE(ck.ok()) << ck.status().to_string();
    EXPECT_EQ(ck.value().num_files(), 2u);
    EXPECT_EQ(ck.value().tensor_names(), (std::vector<std::string>{"a", "b", "c"}));
    ASSERT_NE(ck.value().find("c"), nullptr);
    EXPECT_EQ(ck.value().find("c")->dtype, DType::kE4M3);
    EXPECT_EQ(ck.value().find("zz"), nullptr);
    auto rb = ck.value().read("b");
    ASSERT_TRUE(rb.ok());
    EXPECT_EQ(std::memcmp(rb.value().data(), b.data(), b.nbytes()), 0);
    auto va = ck.value().view("a");
    ASSERT_TRUE(va.ok());
    EXPECT_EQ(std::memcmp(va.value().data, a.data(), a.nbytes()), 0);
    EXPECT_FALSE(ck.value().view("zz").ok());
  }
}

TEST(Checkpoint, BadIndexesAreRejected) {
  Tensor a(DType::kF32, {2});
  a.fill_bytes(0);
  struct Case {
    const char* index;
    const char* needle;
  };
  const Case cases[] = {
      {R"({"weight_map":{"a":"s1.safetensors","b":"s1.safetensors"}})",
       "puts \"b\" in s1.safetensors, which does not hold it"},
      {R"({"weight_map":{"a":"../s1.safetensors"}})", "not a file inside"},
      {R"({"weight_map":{"a":"/abs.safetensors"}})", "not a file inside"},
      {R"({"weight_map":{"a":3}})", "must be a file name"},
      {R"({"weights":{}})", "\"weight_map\" object"},
      {R"({"weight_map":)", "not valid JSON"},
      {R"({"weight_map":{"a":"missing.safetensors"}})", "missing.safetensors"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.index);
    ScratchDir dir("ckpt_bad");
    ASSERT_TRUE(write_safetensors(dir.file("s1.safetensors"), {{"a", a.view()}}).ok());
    dir.write_text("model.safetensors.index.json", c.index);
    auto ck = Checkpoint::open(dir.path());
    ASSERT_FALSE(ck.ok());
    EXPECT_NE(ck.status().message().find(c.needle), std::string::npos) << ck.status().to_string();
  }
}

TEST(Checkpoint, DirectoryWithoutIndex) {
  Tensor a(DType::kF32, {2});
  a.fill_bytes(0);
  {
    ScratchDir dir("ckpt_single");
    ASSERT_TRUE(write_safetensors(dir.file("weights.safetensors"), {{"a", a.view()}}).ok());
    auto ck = Checkpoint::open(dir.path());
    ASSERT_TRUE(ck.ok()) << ck.status().to_string();
    EXPECT_TRUE(ck.value().contains("a"));
    auto direct = Checkpoint::open(dir.file("weights.safetensors"));
    ASSERT_TRUE(direct.ok());
    EXPECT_TRUE(direct.value().contains("a"));
  }
  {
    ScratchDir dir("ckpt_two");
    ASSERT_TRUE(write_safetensors(dir.file("x.safetensors"), {{"a", a.view()}}).ok());
    ASSERT_TRUE(write_safetensors(dir.file("y.safetensors"), {{"b", a.view()}}).ok());
    auto ck = Checkpoint::open(dir.path());
    ASSERT_FALSE(ck.ok());
    EXPECT_NE(ck.status().message().find("need exactly one"), std::string::npos);
  }
  {
    // Two files holding the same name cannot form one checkpoint.
    auto f1 = SafetensorsFile::from_bytes(encode_safetensors({{"a", a.view()}}).value(), "f1");
    auto f2 = SafetensorsFile::from_bytes(encode_safetensors({{"a", a.view()}}).value(), "f2");
    ASSERT_TRUE(f1.ok() && f2.ok());
    auto ck = Checkpoint::from_files({f1.value(), f2.value()});
    ASSERT_FALSE(ck.ok());
    EXPECT_NE(ck.status().message().find("\"a\" is in both f1 and f2"), std::string::npos)
        << ck.status().to_string();
  }
}

}  // namespace
}  // namespace m3attn
