/* The block_scores module for every other CPU, by GCC vector extensions: vectors of 8 floats (one AVX2 register)
   where the variant is built with -mavx2 -mfma, of 4 (one SSE register) in the generic one; bf16 keys widened to
   fp32 as they are read. Built twice (h2ochat_kernels/cpu/variants.py): "avx2" and "generic". */

#include "vectors_portable.h"

#include "block_scores_body.h"

/* key_tile (block_scores_body.h says what it computes) */
static inline __attribute__((always_inline)) void key_tile(const char *keys, int64_t key_channel, int64_t t,
                                                           int64_t D, int64_t bytes, const float *q,
                                                           const uint32_t *pairs, const int GT,
                                                           vf acc[QUERY_TILE]) {
  (void)pairs;
  for (int g = 0; g < GT; g++) acc[g] = vzero();
  if (bytes == 4) {
    const float *k = (const float *)keys + t;
    for (int64_t d = 0; d < D; d++) {
      const vf v = vload(k + d * key_channel);
      for (int g = 0; g < GT; g++) acc[g] = vfma(vset1(q[g * D + d]), v, acc[g]);
    }
  } else {
    const uint16_t *k = (const uint16_t *)keys + t;
    for (int64_t d = 0; d < D; d++) {
      vh halves;
      memcpy(&halves, k + d * key_channel, sizeof halves);
      const vf v = (vf)(__builtin_convertvector(halves, vu) << 16);
      for (int g = 0; g < GT; g++) acc[g] = vfma(vset1(q[g * D + d]), v, acc[g]);
    }
  }
}
