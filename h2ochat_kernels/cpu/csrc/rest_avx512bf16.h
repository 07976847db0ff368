/* The rest's page weights and sums by 16-lane AVX-512 vectors (exp_lanes). */

#pragma once

/* e^x in 16 lanes, for x <= 0 (below -87: e^-87, ~1.6e-38): x = n ln 2 + r, |r| <= ln 2 / 2, e^r by its Taylor
   polynomial to r^6 (relative error below 2e-7, a float's rounding), times 2^n. */
static inline __m512 exp_lanes(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x); /* (ln 2 in two parts: r exact) */
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

/* w[n] = the sum over page n's slots t of e^(scale * (dots[t] - top)) (the row padded to 16). Pages of a power
   of two up to 16 slots: 16 pages at a time, their P vectors of exps added pairwise lane by lane (even lanes plus
   odd ones, log2 P times: the 16 sums in page order, ~1.3 ops a page where a tree across each vector's lanes took
   ~5); other pages: the exps written over dots, then summed page by page. */
static void page_sums(float *dots, float top, float scale, int64_t filled, int64_t P, float *w) {
  const int64_t pages = (filled + P - 1) / P;
  const __m512 shift = _mm512_set1_ps(top), factor = _mm512_set1_ps(scale);
  if (P <= 16 && (P & (P - 1)) == 0) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t n = 0; n < pages; n += 16) {
      __m512 part[16];
      for (int64_t j = 0; j < P; j++) {
        const int64_t t = n * P + j * 16;
        part[j] = t < filled ? _mm512_maskz_mov_ps(lanes(filled, t), exp_lanes(_mm512_mul_ps(
                                   _mm512_sub_ps(_mm512_loadu_ps(dots + t), shift), factor)))
                             : _mm512_setzero_ps();
      }
      for (int64_t count = P; count > 1; count /= 2)
        for (int64_t j = 0; j < count / 2; j++)
          part[j] = _mm512_add_ps(_mm512_permutex2var_ps(part[2 * j], even, part[2 * j + 1]),
                                  _mm512_permutex2var_ps(part[2 * j], odd, part[2 * j + 1]));
      _mm512_mask_storeu_ps(w + n, lanes(pages, n), part[0]);
    }
  } else {
    for (int64_t t = 0; t < filled; t += 16)
      _mm512_storeu_ps(dots + t, exp_lanes(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(dots + t), shift), factor)));
    for (int64_t n = 0; n < pages; n++) {
      float sum = 0.0f;
      for (int64_t t = n * P; t < filled && t < (n + 1) * P; t++) sum += dots[t];
      w[n] = sum;
    }
  }
}

/* The recalled pages' weights w[n] zeroed; returns the sum of the others. */
static float unrecalled_sum(float *w, int64_t pages, const uint8_t *recalled) {
  __m512 total = _mm512_setzero_ps();
  for (int64_t n = 0; n < pages; n += 16) {
    const __mmask16 mask = lanes(pages, n);
    __m512 weight = _mm512_maskz_loadu_ps(mask, w + n);
    weight = _mm512_maskz_mov_ps(mask & ~live_lanes(recalled, n, pages - n < 16 ? pages - n : 16), weight);
    _mm512_mask_storeu_ps(w + n, mask, weight);
    total = _mm512_add_ps(total, weight);
  }
  return _mm512_reduce_add_ps(total);
}

/* The largest of row[0, n). */
static inline float row_max(const float *row, int64_t n) {
  __m512 largest = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; t += 16) largest = _mm512_mask_max_ps(largest, lanes(n, t), largest, _mm512_loadu_ps(row + t));
  return _mm512_reduce_max_ps(largest);
}

/* v[0, n) *= factor. */
static inline void scale_floats(float *v, int64_t n, float factor) {
  const __m512 by = _mm512_set1_ps(factor);
  for (int64_t d = 0; d < n; d += 16)
    _mm512_mask_storeu_ps(v + d, lanes(n, d), _mm512_mul_ps(by, _mm512_maskz_loadu_ps(lanes(n, d), v + d)));
}

#define REST_QUERIES 4  /* queries whose sums one pass over the page means keeps in registers */
#define REST_CHANNELS 4 /* vectors of 16 channels of each (4 x 4 sums: 16 of the 32 registers) */

/* value[m * Dv ...] = sum over the pages n not recalled of w[m * pages + n] * mean_n, mean_n at means + n * Dv for
   n < meaned, else (the last, part page) at part: the sums in registers, REST_QUERIES queries by 64 channels a
   pass (a head dim of 64: one pass reads each mean once, whole; the next pages' asked for ahead). */
static void weigh_means(const float *w, int64_t M, int64_t pages, const uint8_t *recalled, const float *means,
                        int64_t meaned, const float *part, int64_t Dv, float *value) {
  for (int64_t m0 = 0; m0 < M; m0 += REST_QUERIES)
    for (int64_t d = 0; d < Dv; d += 16 * REST_CHANNELS) {
      __mmask16 mask[REST_CHANNELS];
      __m512 sum[REST_QUERIES][REST_CHANNELS];
      for (int c = 0; c < REST_CHANNELS; c++) {
        mask[c] = d + 16 * c < Dv ? lanes(Dv, d + 16 * c) : 0;
        for (int j = 0; j < REST_QUERIES; j++) sum[j][c] = _mm512_setzero_ps();
      }
      for (int64_t n = 0; n < pages; n++) {
        if (recalled[n]) continue;
        const float *mean = n < meaned ? means + n * Dv : part;
        if (n + 4 < meaned)
          for (int64_t c = 0; c < 16 * REST_CHANNELS && d + c < Dv; c += 16)
            _mm_prefetch((const char *)(means + (n + 4) * Dv + d + c), _MM_HINT_T0);
        __m512 v[REST_CHANNELS];
        for (int c = 0; c < REST_CHANNELS; c++) v[c] = _mm512_maskz_loadu_ps(mask[c], mean + d + 16 * c);
        for (int j = 0; j < REST_QUERIES; j++) {
          if (m0 + j >= M) break;
          const __m512 weight = _mm512_set1_ps(w[(m0 + j) * pages + n]);
          for (int c = 0; c < REST_CHANNELS; c++) sum[j][c] = _mm512_fmadd_ps(weight, v[c], sum[j][c]);
        }
      }
      for (int j = 0; j < REST_QUERIES && m0 + j < M; j++)
        for (int c = 0; c < REST_CHANNELS; c++)
          _mm512_mask_storeu_ps(value + (m0 + j) * Dv + d + 16 * c, mask[c], sum[j][c]);
    }
}

