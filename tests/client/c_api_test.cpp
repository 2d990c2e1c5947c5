// The C ABI's version-2 entry points on host memory: each reaches its typed op (the CPU fallback
// gives the op's result), each reports the op's error codes with a message, and none resolves a
// kernel. The numerics of every op against a reference are tested in tests/python/test_cpu.py.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kiln/kiln.h"

namespace {

kiln_tensor host(void* data, kiln_dtype dtype, int rank, const int64_t* shape) {
  return kiln_tensor{data, dtype, rank, shape, nullptr, KILN_CPU, 0};
}

std::string last_error() { return kiln_last_error(); }

TEST(CApi, VersionThree) { EXPECT_GE(kiln_abi_version(), 3); }

// Version 3: quantize, FP8 GEMM and the fused gated MLP on host memory.
TEST(CApi, QuantizeFp8GemmAndGatedMlp) {
  const int64_t xs[2] = {2, 16}, ss[1] = {1}, ws[2] = {3, 16}, os[2] = {2, 3};
  alignas(16) float x[32], w[48], sa[1], sb[1];
  for (int i = 0; i < 32; ++i) x[i] = float(i % 5) - 2.0f;
  for (int i = 0; i < 48; ++i) w[i] = float(i % 3) - 1.0f;
  alignas(16) uint8_t qa[32], qw[48];
  kiln_tensor tx = host(x, KILN_F32, 2, xs), tqa = host(qa, KILN_U8, 2, xs), tsa = host(sa, KILN_F32, 1, ss);
  kiln_tensor tw = host(w, KILN_F32, 2, ws), tqw = host(qw, KILN_U8, 2, ws), tsb = host(sb, KILN_F32, 1, ss);
  ASSERT_EQ(kiln_quantize_fp8(nullptr, &tx, &tqa, &tsa, KILN_FP8_TENSOR, 0, nullptr), KILN_OK) << last_error();
  ASSERT_EQ(kiln_quantize_fp8(nullptr, &tw, &tqw, &tsb, KILN_FP8_TENSOR, 0, nullptr), KILN_OK) << last_error();
  EXPECT_FLOAT_EQ(sa[0], 2.0f / 448);
  EXPECT_EQ(kiln_quantize_fp8(nullptr, &tx, &tqa, &tsa, 7, 0, nullptr), KILN_INVALID_ARGUMENT);
  // b is the transposed view of qw [3, 16]: shape [16, 3], strides {1, 16}.
  const int64_t bshape[2] = {16, 3}, bstrides[2] = {1, 16};
  kiln_tensor tb{qw, KILN_U8, 2, bshape, bstrides, KILN_CPU, 0};
  alignas(16) uint16_t out[6];
  kiln_tensor to = host(out, KILN_F16, 2, os);
  ASSERT_EQ(kiln_fp8_gemm(nullptr, &tqa, &tb, &tsa, &tsb, &to, nullptr), KILN_OK) << last_error();
  EXPECT_EQ(kiln_fp8_gemm(nullptr, &tqa, &tb, nullptr, &tsb, &to, nullptr), KILN_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("a_scale"), std::string::npos);
  kiln_tensor row_major = host(qw, KILN_U8, 2, bshape);
  EXPECT_EQ(kiln_fp8_gemm(nullptr, &tqa, &row_major, &tsa, &tsb, &to, nullptr), KILN_INVALID_ARGUMENT);

  alignas(16) uint16_t hx[32], hg[48], hu[48], ho[6];
  for (int i = 0; i < 32; ++i) hx[i] = 0x3C00;  // 1.0 in f16
  for (int i = 0; i < 48; ++i) hg[i] = hu[i] = 0x2C00;  // 1/16
  kiln_tensor gx = host(hx, KILN_F16, 2, xs), gg = host(hg, KILN_F16, 2, ws), gu = host(hu, KILN_F16, 2, ws),
              go = host(ho, KILN_F16, 2, os);
  ASSERT_EQ(kiln_fused_gated_mlp(nullptr, &gx, &gg, &gu, &go, KILN_GATED_SILU, nullptr), KILN_OK) << last_error();
  EXPECT_EQ(ho[0], 0x39D9);  // silu(1) * 1 = 0.7310586 -> f16 0x39D9
  EXPECT_EQ(kiln_fused_gated_mlp(nullptr, &gx, &gg, &gu, &go, 5, nullptr), KILN_INVALID_ARGUMENT);
}

TEST(CApi, RmsNormWithInvRmsAndBackward) {
  const int64_t xs[2] = {2, 4}, ws[1] = {4}, rs[1] = {2};
  std::vector<float> x = {1, 2, 3, 4, -1, 0, 1, 0}, w = {1, 1, 2, 1}, y(8), inv(2), dy(8, 1.f), dx(8), dw(4);
  kiln_tensor tx = host(x.data(), KILN_F32, 2, xs), tw = host(w.data(), KILN_F32, 1, ws),
              ty = host(y.data(), KILN_F32, 2, xs), ti = host(inv.data(), KILN_F32, 1, rs);
  ASSERT_EQ(kiln_rms_norm_inv(nullptr, &tx, &tw, &ty, &ti, 0.0, nullptr), KILN_OK) << last_error();
  EXPECT_NEAR(inv[0], 1.0 / std::sqrt(7.5), 1e-6);
  EXPECT_NEAR(inv[1], 1.0 / std::sqrt(0.5), 1e-6);
  EXPECT_NEAR(y[2], 3 * inv[0] * 2, 1e-5);
  // NULL inv_rms is kiln_rms_norm.
  ASSERT_EQ(kiln_rms_norm_inv(nullptr, &tx, &tw, &ty, nullptr, 0.0, nullptr), KILN_OK) << last_error();

  kiln_tensor tdy = host(dy.data(), KILN_F32, 2, xs), tdx = host(dx.data(), KILN_F32, 2, xs),
              tdw = host(dw.data(), KILN_F32, 1, ws);
  ASSERT_EQ(kiln_rms_norm_backward(nullptr, &tdy, &tx, &tw, &ti, &tdx, &tdw, nullptr, nullptr), KILN_OK)
      << last_error();
  // dw = sum over rows of dy * x * inv_rms.
  EXPECT_NEAR(dw[0], 1 * inv[0] - 1 * inv[1], 1e-5);
  int64_t elements = -1;
  ASSERT_EQ(kiln_rms_norm_backward_workspace_elements(&tx, &elements), KILN_OK);
  EXPECT_EQ(elements, 0);  // host tensors need none
  EXPECT_EQ(kiln_rms_norm_backward_workspace_elements(&tx, nullptr), KILN_INVALID_ARGUMENT);

  kiln_tensor bad_inv = host(inv.data(), KILN_F16, 1, rs);
  EXPECT_EQ(kiln_rms_norm_backward(nullptr, &tdy, &tx, &tw, &bad_inv, &tdx, &tdw, nullptr, nullptr),
            KILN_UNSUPPORTED_DTYPE);
  EXPECT_NE(last_error().find("inv_rms"), std::string::npos);
}

TEST(CApi, AddRmsNormAndActAndMul) {
  const int64_t xs[2] = {1, 4}, ws[1] = {4}, hs[2] = {1, 2};
  std::vector<float> x = {1, 2, 3, 4}, r = {1, 1, 1, 1}, w(4, 1.f), y(4), ro(4), h(2);
  kiln_tensor tx = host(x.data(), KILN_F32, 2, xs), tr = host(r.data(), KILN_F32, 2, xs),
              tw = host(w.data(), KILN_F32, 1, ws), ty = host(y.data(), KILN_F32, 2, xs),
              tro = host(ro.data(), KILN_F32, 2, xs);
  ASSERT_EQ(kiln_add_rms_norm(nullptr, &tx, &tr, &tw, &ty, &tro, 0.0, nullptr), KILN_OK) << last_error();
  EXPECT_EQ(ro, (std::vector<float>{2, 3, 4, 5}));
  kiln_tensor th = host(h.data(), KILN_F32, 2, hs);
  ASSERT_EQ(kiln_act_and_mul(nullptr, &tx, &th, KILN_SILU, nullptr), KILN_OK) << last_error();
  EXPECT_NEAR(h[0], 1 / (1 + std::exp(-1.0)) * 3, 1e-6);
  EXPECT_EQ(kiln_act_and_mul(nullptr, &tx, &th, 7, nullptr), KILN_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("activation"), std::string::npos);
  EXPECT_EQ(kiln_add_rms_norm(nullptr, &tx, &tr, &tw, &ty, nullptr, 0.0, nullptr), KILN_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("residual_out"), std::string::npos);
}

TEST(CApi, RopeAndFusedRope) {
  const int64_t qs[3] = {1, 1, 64}, cs[2] = {2, 32}, ps[1] = {1};
  std::vector<float> q(64, 1.f), k(64, 1.f), cos(64, 1.f), sin(64, 0.f), qo(64), ko(64);
  std::vector<int64_t> pos = {1};
  kiln_tensor tq = host(q.data(), KILN_F32, 3, qs), tk = host(k.data(), KILN_F32, 3, qs),
              tc = host(cos.data(), KILN_F32, 2, cs), ts = host(sin.data(), KILN_F32, 2, cs),
              tp = host(pos.data(), KILN_I64, 1, ps), tqo = host(qo.data(), KILN_F32, 3, qs),
              tko = host(ko.data(), KILN_F32, 3, qs);
  ASSERT_EQ(kiln_apply_rope_qk(nullptr, &tq, &tk, &tc, &ts, &tp, &tqo, &tko, KILN_ROPE_GPTJ, nullptr), KILN_OK)
      << last_error();
  EXPECT_EQ(qo, q);  // cos 1, sin 0: the identity
  EXPECT_EQ(kiln_apply_rope_qk(nullptr, &tq, &tk, &tc, &ts, &tp, &tqo, &tko, 2, nullptr), KILN_INVALID_ARGUMENT);

  const int64_t xs[3] = {1, 2, 64}, ws[1] = {64}, fcs[2] = {2, 64};
  std::vector<float> x(128, 1.f), w(64, 1.f), fc(128, 1.f), out(128);
  kiln_tensor tx = host(x.data(), KILN_F32, 3, xs), tw = host(w.data(), KILN_F32, 1, ws),
              tfc = host(fc.data(), KILN_F32, 2, fcs), tout = host(out.data(), KILN_F32, 3, xs);
  EXPECT_EQ(kiln_rms_norm_rope(nullptr, &tx, &tw, &tfc, &tfc, &tout, 1e-6, 0, nullptr), KILN_DEVICE_ERROR);
  EXPECT_NE(last_error().find("not a CUDA tensor"), std::string::npos);
}

TEST(CApi, PointerDeviceAndCounters) {
  int host_value = 0;
  int32_t kind = -1, index = -1;
  ASSERT_EQ(kiln_pointer_device(&host_value, &kind, &index), KILN_OK);
  EXPECT_EQ(kind, KILN_CPU);
  EXPECT_EQ(kiln_pointer_device(&host_value, nullptr, &index), KILN_INVALID_ARGUMENT);

  kiln_runtime* rt = nullptr;
  ASSERT_EQ(kiln_runtime_create("embedded", &rt), KILN_OK) << last_error();
  kiln_runtime_counters c{-1, -1, -1, -1};
  ASSERT_EQ(kiln_runtime_get_counters(rt, &c), KILN_OK);
  EXPECT_EQ(c.module_loads, 0);
  EXPECT_EQ(c.from_embedded, 0);
  EXPECT_EQ(kiln_runtime_get_counters(rt, nullptr), KILN_INVALID_ARGUMENT);
  EXPECT_STREQ(kiln_runtime_resolver_name(rt), kiln_runtime_resolver(rt));
  kiln_runtime_destroy(rt);
}

}  // namespace
