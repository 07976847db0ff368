/* The block_scores module for CPUs with AVX512-BF16: 16-lane vectors; bf16 keys dotted by VDPBF16PS (two channels
   of 16 tokens interleaved into pairs, each pair times the query's pair: products exact, summed in fp32), fp32 keys
   by FMA. Built with -mavx512f -mavx512bw -mavx512bf16 (h2ochat_kernels/cpu/variants.py); loaded only where the
   CPU has avx512_bf16. */

#include <immintrin.h>

#include "vectors_avx512.h"

#include "block_scores_body.h"

static inline __m512i widened_halves(const uint16_t *p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
}

/* key_tile (block_scores_body.h says what it computes) */
static inline __attribute__((always_inline)) void key_tile(const char *keys, int64_t key_channel, int64_t t,
                                                           int64_t D, int64_t bytes, const float *q,
                                                           const uint32_t *pairs, const int GT,
                                                           vf acc[QUERY_TILE]) {
  for (int g = 0; g < GT; g++) acc[g] = vzero();
  if (bytes == 4) {
    const float *k = (const float *)keys + t;
    for (int64_t d = 0; d < D; d++) {
      const vf v = _mm512_loadu_ps(k + d * key_channel);
      for (int g = 0; g < GT; g++) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + d]), v, acc[g]);
    }
    return;
  }
  const uint16_t *k = (const uint16_t *)keys + t;
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i++) {
    const __m512i low = widened_halves(k + 2 * i * key_channel), high = widened_halves(k + (2 * i + 1) * key_channel);
    const __m512bh both = (__m512bh)_mm512_or_si512(low, _mm512_slli_epi32(high, 16));
    for (int g = 0; g < GT; g++)
      acc[g] = _mm512_dpbf16_ps(acc[g], both, (__m512bh)_mm512_set1_epi32((int)pairs[g * half + i]));
  }
  if (D % 2) { /* the last channel of an odd head size, widened */
    const vf v = _mm512_castsi512_ps(_mm512_slli_epi32(widened_halves(k + (D - 1) * key_channel), 16));
    for (int g = 0; g < GT; g++) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + D - 1]), v, acc[g]);
  }
}
