/* Folding vectors of lane sums (AVX-512), for the page scores of the recall module and the key dots of the
   attention module. */

#pragma once

#include <immintrin.h>

/* Two vectors of lane sums folded into one of half as many: a's in the lanes of a mask, b's in the others
   (a blend of the lanes that stay, plus one shuffle of the lanes that cross over). By 256, 128, 64 and 32
   bits, four folds take 16 keys' vectors to one lane a key (_mm512_reduce_add_ps's adds, in its order:
   the same fp32 sums), 15 adds for the 16 where each horizontal sum takes ~4 shuffles and 4 adds. */
static inline __m512 fold_256(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_mask_blend_ps(0xff00, a, b), _mm512_shuffle_f32x4(a, b, 0x4e));
}
static inline __m512 fold_128(__m512 a, __m512 b) {
  const __m512i crossed = _mm512_set_epi32(27, 26, 25, 24, 15, 14, 13, 12, 19, 18, 17, 16, 7, 6, 5, 4);
  return _mm512_add_ps(_mm512_mask_blend_ps(0xf0f0, a, b), _mm512_permutex2var_ps(a, crossed, b));
}
static inline __m512 fold_64(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_mask_blend_ps(0xcccc, a, b), _mm512_shuffle_ps(a, b, 0x4e));
}
static inline __m512 fold_32(__m512 a, __m512 b) {
  const __m512i crossed = _mm512_set_epi32(30, 15, 28, 13, 26, 11, 24, 9, 22, 7, 20, 5, 18, 3, 16, 1);
  return _mm512_add_ps(_mm512_mask_blend_ps(0xaaaa, a, b), _mm512_permutex2var_ps(a, crossed, b));
}
