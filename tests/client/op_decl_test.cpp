// Ops by declaration (kiln/op.h) and the C ABI over them (ABI version 4): every registered op's
// declaration is well formed and names real gradients; kiln_op_call reaches the same typed op as
// the named entry point; kiln_op_infer gives the shapes kiln allocates; bad calls are typed errors
// before anything runs; kiln_launch checks its family, problem and buffers before any launch.
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kiln/family.h"
#include "kiln/kiln.h"
#include "kiln/op.h"

namespace {

kiln_tensor host(void* data, kiln_dtype dtype, int rank, const int64_t* shape) {
  return kiln_tensor{data, dtype, rank, shape, nullptr, KILN_CPU, 0};
}

const kiln_op* find(const char* name) {
  const kiln_op* op = nullptr;
  EXPECT_EQ(kiln_op_find(name, &op), KILN_OK) << name << ": " << kiln_last_error();
  return op;
}

TEST(OpDecl, EveryOpIsWellFormedAndItsGradientsNameRealTensors) {
  int32_t n = 0;
  ASSERT_EQ(kiln_op_count(&n), KILN_OK);
  const auto ops = kiln::Registry::global().ops();
  ASSERT_EQ(std::size_t(n), ops.size());
  std::set<std::string> names;
  for (int32_t i = 0; i < n; ++i) {
    const kiln_op* op = nullptr;
    ASSERT_EQ(kiln_op_at(i, &op), KILN_OK);
    const auto j = nlohmann::json::parse(kiln_op_describe(op));
    names.insert(j["name"].get<std::string>());
    EXPECT_TRUE(ops[std::size_t(i)]->check().ok()) << j["name"];
  }
  // The typed ops of kiln/ops.h, each declared once.
  for (const char* name : {"rms_norm", "rms_norm_backward", "add_rms_norm", "act_and_mul", "apply_rope_qk",
                           "rms_norm_rope", "quantize_fp8", "fp8_gemm", "fused_gated_mlp"})
    EXPECT_TRUE(names.count(name)) << name;
  for (const kiln::OpDecl* op : ops) {
    if (op->backward.empty()) continue;
    const kiln::OpDecl* bwd = kiln::Registry::global().find_op(op->backward);
    ASSERT_NE(bwd, nullptr) << op->name << " names a missing backward " << op->backward;
    int grads_in = 0;
    for (const auto& t : bwd->tensors) {
      if (t.grad_of.empty()) {
        // Every other input is a forward tensor of the same name (the autograd binding saves it).
        if (t.role == kiln::TensorRole::input && !t.optional) {
          EXPECT_LT(op->tensor_index(t.name), op->tensors.size()) << bwd->name << "." << t.name;
        }
        continue;
      }
      const std::size_t f = op->tensor_index(t.grad_of);
      ASSERT_LT(f, op->tensors.size()) << bwd->name << "." << t.name << " is the gradient of an unknown " << t.grad_of;
      // An input gradient is of a forward output; an output gradient of a forward input.
      EXPECT_EQ(t.role == kiln::TensorRole::input, op->tensors[f].role == kiln::TensorRole::output)
          << bwd->name << "." << t.name;
      grads_in += t.role == kiln::TensorRole::input;
    }
    EXPECT_GE(grads_in, 1) << bwd->name;
  }
}

TEST(OpDecl, DescribeSaysWhichTensorsTakeStridedRows) {
  // The bindings pass a row-strided view only where the declaration says the op reads it.
  const auto marked = [](const char* op_name) {
    const kiln_op* op = nullptr;
    EXPECT_EQ(kiln_op_find(op_name, &op), KILN_OK) << op_name;
    std::set<std::string> out;
    if (!op) return out;
    const auto j = nlohmann::json::parse(kiln_op_describe(op));
    for (const auto& t : j.at("tensors"))
      if (t.at("strided_rows").get<bool>()) out.insert(t.at("name").get<std::string>());
    return out;
  };
  EXPECT_EQ(marked("act_and_mul_backward"), (std::set<std::string>{"x", "dy", "dx"}));
  EXPECT_EQ(marked("rms_norm_backward"), (std::set<std::string>{"dy", "x", "dx"}));
  EXPECT_EQ(marked("add_rms_norm_backward"), (std::set<std::string>{"dy", "dh", "h", "dx"}));
  EXPECT_EQ(marked("add_rms_norm"), (std::set<std::string>{"x", "residual", "out", "residual_out"}));
  EXPECT_EQ(marked("layer_norm"), (std::set<std::string>{"x", "out"}));
  EXPECT_EQ(marked("layer_norm_backward"), (std::set<std::string>{"dy", "x", "dx"}));
  // Unmarked tensors are made contiguous by the bindings.
  EXPECT_TRUE(marked("quantize_fp8").empty());
}

TEST(OpDecl, ChecksRejectMalformedDeclarations) {
  kiln::OpDecl op;
  op.name = "Bad";
  EXPECT_EQ(op.check().code(), kiln::Code::invalid_argument);
  op.name = "fine";
  op.run = [](const kiln::OpCall&) { return kiln::Status{}; };
  op.infer = [](const kiln::OpCall&, std::span<kiln::OutputShape>) { return kiln::Status{}; };
  op.tensors = {{.name = "out", .role = kiln::TensorRole::output}, {.name = "x"}};
  EXPECT_EQ(op.check().code(), kiln::Code::invalid_argument);  // an input after an output
  op.tensors = {{.name = "x"}, {.name = "out", .role = kiln::TensorRole::output}};
  EXPECT_TRUE(op.check().ok());
  op.scalars = {{.name = "x"}};
  EXPECT_EQ(op.check().code(), kiln::Code::invalid_argument);  // a name used twice
  op.scalars = {{.name = "mode", .kind = kiln::ScalarKind::choice, .has_default = true, .default_value = 2,
                 .choices = {"a", "b"}}};
  EXPECT_EQ(op.check().code(), kiln::Code::invalid_argument);  // a default outside the choices
  kiln::Registry r;
  op.scalars.clear();
  EXPECT_TRUE(r.add_op(op).ok());
  EXPECT_EQ(r.add_op(op).code(), kiln::Code::invalid_argument);  // the name is taken
}

TEST(OpDecl, CallReachesTheTypedOpAndMatchesTheNamedEntry) {
  const int64_t xs[2] = {2, 8}, ws[1] = {8}, rs[1] = {2};
  float x[16], w[8], y1[16], y2[16], inv[2];
  for (int i = 0; i < 16; ++i) x[i] = float(i % 7) - 3.0f;
  for (int i = 0; i < 8; ++i) w[i] = 0.5f + float(i) / 8;
  kiln_tensor tx = host(x, KILN_F32, 2, xs), tw = host(w, KILN_F32, 1, ws), ty1 = host(y1, KILN_F32, 2, xs),
              ty2 = host(y2, KILN_F32, 2, xs), tinv = host(inv, KILN_F32, 1, rs);
  ASSERT_EQ(kiln_rms_norm(nullptr, &tx, &tw, &ty1, 1e-6, nullptr), KILN_OK) << kiln_last_error();
  const kiln_op* op = find("rms_norm");
  const kiln_tensor* ts[4] = {&tx, &tw, &ty2, &tinv};
  kiln_value eps{1e-6, 0};
  ASSERT_EQ(kiln_op_call(nullptr, op, ts, 4, &eps, 1, nullptr), KILN_OK) << kiln_last_error();
  EXPECT_EQ(std::memcmp(y1, y2, sizeof y1), 0);
  EXPECT_GT(inv[0], 0.f);
  // The optional inv_rms may be absent.
  const kiln_tensor* no_inv[4] = {&tx, &tw, &ty2, nullptr};
  EXPECT_EQ(kiln_op_call(nullptr, op, no_inv, 4, &eps, 1, nullptr), KILN_OK) << kiln_last_error();
  // A required tensor absent, a wrong count, a bad dtype, a choice out of range: typed errors.
  const kiln_tensor* no_w[4] = {&tx, nullptr, &ty2, nullptr};
  EXPECT_EQ(kiln_op_call(nullptr, op, no_w, 4, &eps, 1, nullptr), KILN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kiln_last_error()).find("weight is required"), std::string::npos);
  EXPECT_EQ(kiln_op_call(nullptr, op, ts, 3, &eps, 1, nullptr), KILN_INVALID_ARGUMENT);
  EXPECT_EQ(kiln_op_call(nullptr, op, ts, 4, nullptr, 0, nullptr), KILN_INVALID_ARGUMENT);
  int32_t ix[16];
  kiln_tensor ti = host(ix, KILN_I32, 2, xs);
  const kiln_tensor* bad_dtype[4] = {&ti, &tw, &ty2, nullptr};
  EXPECT_EQ(kiln_op_call(nullptr, op, bad_dtype, 4, &eps, 1, nullptr), KILN_UNSUPPORTED_DTYPE);
  const kiln_op* am = find("act_and_mul");
  const int64_t hs[2] = {2, 4};
  kiln_tensor th = host(y1, KILN_F32, 2, hs);
  const kiln_tensor* am_ts[2] = {&tx, &th};
  kiln_value act{0, 7};
  EXPECT_EQ(kiln_op_call(nullptr, am, am_ts, 2, &act, 1, nullptr), KILN_INVALID_ARGUMENT);
  act.i64 = 1;
  EXPECT_EQ(kiln_op_call(nullptr, am, am_ts, 2, &act, 1, nullptr), KILN_OK) << kiln_last_error();
  const kiln_op* missing = nullptr;
  EXPECT_EQ(kiln_op_find("no_such_op", &missing), KILN_NOT_FOUND);
}

TEST(OpDecl, InferGivesTheOutputsKilnAllocates) {
  const int64_t xs[3] = {4, 5, 256};
  kiln_tensor tx = host(nullptr, KILN_BF16, 3, xs);  // shapes only: no data needed
  kiln_shape out[2];
  const kiln_tensor* am[2] = {&tx, nullptr};
  kiln_value silu{0, 0};
  ASSERT_EQ(kiln_op_infer(find("act_and_mul"), am, 2, &silu, 1, out, 1), KILN_OK) << kiln_last_error();
  EXPECT_EQ(out[0].dtype, KILN_BF16);
  EXPECT_EQ(out[0].rank, 3);
  EXPECT_EQ(out[0].shape[2], 128);
  const kiln_tensor* q[3] = {&tx, nullptr, nullptr};
  kiln_value qs[2] = {{0, 1}, {0, 0}};  // 1x128, no transpose
  ASSERT_EQ(kiln_op_infer(find("quantize_fp8"), q, 3, qs, 2, out, 2), KILN_OK) << kiln_last_error();
  EXPECT_EQ(out[0].dtype, KILN_U8);
  EXPECT_EQ(out[1].dtype, KILN_F32);
  EXPECT_EQ(out[1].rank, 2);
  EXPECT_EQ(out[1].shape[0], 20);
  EXPECT_EQ(out[1].shape[1], 2);
  const int64_t odd[2] = {3, 7};
  kiln_tensor todd = host(nullptr, KILN_F32, 2, odd);
  const kiln_tensor* bad[2] = {&todd, nullptr};
  EXPECT_EQ(kiln_op_infer(find("act_and_mul"), bad, 2, &silu, 1, out, 1), KILN_SHAPE_MISMATCH);
  EXPECT_EQ(kiln_op_infer(find("act_and_mul"), am, 2, &silu, 1, out, 2), KILN_INVALID_ARGUMENT);
}

TEST(OpDecl, LaunchChecksFamilyProblemAndBuffersFirst) {
  kiln_value two[2] = {};
  float buf[256];
  void* buffers[3] = {buf, buf, buf};
  EXPECT_EQ(kiln_launch(nullptr, "no_such_family", KILN_F32, two, 2, 16, buffers, 3, nullptr), KILN_NOT_FOUND);
  const kiln::Family* am = kiln::Registry::global().find("act_and_mul");
  ASSERT_NE(am, nullptr);
  const auto n = am->problem_fields().size();
  EXPECT_EQ(kiln_launch(nullptr, "act_and_mul", KILN_F32, two, 2, 16, buffers, 2, nullptr), KILN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kiln_last_error()).find("takes " + std::to_string(n) + " problem fields"), std::string::npos)
      << kiln_last_error();
  std::vector<kiln_value> fields(n);
  for (const auto& f : am->problem_fields()) {
    const std::int64_t v = f.name == "rows" ? 4 : f.name == "d" || f.name == "out_row_stride" ? 32
                           : f.name == "x_row_stride"                                    ? 64
                                                                                          : 0;
    fields[f.slot].i64 = v;
  }
  EXPECT_EQ(kiln_launch(nullptr, "act_and_mul", KILN_F32, fields.data(), int32_t(n), 16, buffers, 3, nullptr),
            KILN_INVALID_ARGUMENT);  // two buffers, not three
  // Host memory: a device_error, never a launch.
  EXPECT_EQ(kiln_launch(nullptr, "act_and_mul", KILN_F32, fields.data(), int32_t(n), 16, buffers, 2, nullptr),
            KILN_DEVICE_ERROR);
}

TEST(OpDecl, FamiliesDescribeTheirProblemFields) {
  const char* d = kiln_family_describe("rope");
  ASSERT_NE(d, nullptr);
  const std::string text = d;
  for (const char* s : {"\"name\":\"rope\"", "\"fields\"", "\"slot\"", "\"key\"", "\"params\""})
    EXPECT_NE(text.find(s), std::string::npos) << s << " in " << text;
  EXPECT_EQ(kiln_family_describe("rope"), d) << "one string per family for the process's life";
  EXPECT_EQ(kiln_family_describe("no_such_family"), nullptr);
  EXPECT_NE(std::string(kiln_last_error()).find("no_such_family"), std::string::npos);
  EXPECT_EQ(kiln_family_describe(nullptr), nullptr);
}

}  // namespace
