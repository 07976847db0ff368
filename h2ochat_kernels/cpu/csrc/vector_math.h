/* What the attention and block_scores modules compute alike on top of a vector kind (vectors_avx512.h or
   vectors_portable.h, included first: LANES fp32 lanes in `vf`; vzero, vset1, vload, vstore, vadd, vmul, vfma, vmax,
   vhsum, vhmax, vround, vscale2 (p * 2^n), vzero_below): a softmax's exponential, and bf16 read as fp32. */

#pragma once

#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (a logit less its row's largest): 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], p the Taylor
   series to r^7 (its error below 1e-8, under fp32's rounding); below EXP_LOW (where exp leaves fp32's normal range)
   0, as near as torch's denormals to be no different in a sum whose largest term is 1. */
#define EXP_LOW (-87.0f)
static inline vf vexp(vf x) {
  const vf clamped = vmax(x, vset1(EXP_LOW));
  const vf n = vround(vmul(clamped, vset1(1.44269504088896341f)));
  vf r = vfma(n, vset1(-0.693145751953125f), clamped); /* ln 2 in two parts: n * the first is exact */
  r = vfma(n, vset1(-1.42860682030941723212e-6f), r);
  vf p = vset1(1.0f / 5040.0f);
  p = vfma(p, r, vset1(1.0f / 720.0f));
  p = vfma(p, r, vset1(1.0f / 120.0f));
  p = vfma(p, r, vset1(1.0f / 24.0f));
  p = vfma(p, r, vset1(1.0f / 6.0f));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.0f));
  p = vfma(p, r, vset1(1.0f));
  return vzero_below(x, EXP_LOW, vscale2(p, n));
}

static inline float from_bf16(uint16_t half) {
  const uint32_t bits = (uint32_t)half << 16;
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

/* element i of a row of `bytes` (2: bf16, 4: fp32) as fp32 */
static inline float element(const char *row, int64_t i, int64_t bytes) {
  return bytes == 4 ? ((const float *)row)[i] : from_bf16(((const uint16_t *)row)[i]);
}
