/* fp32 vectors by GCC vector extensions, for the units built for every other CPU: 8 lanes (one AVX2 register)
   where the variant is built with -mavx2 -mfma, 4 (one SSE register) in the generic one (8-float vectors there are
   register pairs the compiler spills); the same names as vectors_avx512.h, then the math they share. */

#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));

static inline vf vset1(float x) {
  vf v;
  for (int l = 0; l < LANES; l++) v[l] = x;
  return v;
}
static inline vf vzero(void) { return vset1(0.0f); }
static inline vf vload(const float *p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vselect(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }
static inline vf vmax(vf a, vf b) { return vselect(b > a, b, a); }
static inline float vhsum(vf v) {
  float sum = 0.0f;
  for (int l = 0; l < LANES; l++) sum += v[l];
  return sum;
}
static inline float vhmax(vf v) {
  float top = v[0];
  for (int l = 1; l < LANES; l++) top = v[l] > top ? v[l] : top;
  return top;
}
/* to nearest by adding and taking away 1.5 * 2^23 (|x| < 2^22 here: a logit's exponent) */
static inline vf vround(vf x) { return (x + vset1(12582912.0f)) - vset1(12582912.0f); }
/* p * 2^n for whole n in [-126, 0], its exponent bits built directly */
static inline vf vscale2(vf p, vf n) { return p * (vf)((__builtin_convertvector(n, vi) + 127) << 23); }
static inline vf vzero_below(vf x, float limit, vf value) { return vselect(x < vset1(limit), vzero(), value); }

#include "vector_math.h"
