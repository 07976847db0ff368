/* The rest's page weights and sums by vectors of 8 (exp8) or element by element: the same sums as the
   AVX-512 variant's up to their order. */

#pragma once


/* e^x in 8 lanes for x <= 0, exp_lanes' way (x = n ln 2 + r, a degree-6 polynomial, times 2^n; below -87: e^-87):
   the rounding to nearest even by adding and taking away 1.5 * 2^23, 2^n as the exponent's bits. */
static inline lanes8 exp8(lanes8 x) {
  const lanes8 floor_at = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
  x = larger8(floor_at, x);
  const float shifter = 12582912.0f;
  const lanes8 n = (x * 1.44269504088896341f + shifter) - shifter;
  lanes8 r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  lanes8 p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const mask8 power = (__builtin_convertvector(n, mask8) + 127) << 23;
  return p * (lanes8)power;
}

/* The lanes of the 8 slots from t that lie below n: all ones, the others zeros. */
static inline mask8 below8(int64_t t, int64_t n) {
  const mask8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const int32_t left = (int32_t)(n - t < WIDE ? (n - t > 0 ? n - t : 0) : WIDE);
  return lane < (mask8){left, left, left, left, left, left, left, left};
}

/* w[n] = the sum over page n's slots t of e^(scale * (dots[t] - top)) (the row padded to 8): the exps written over
   dots 8 at a time, then summed page by page. */
static void page_sums(float *dots, float top, float scale, int64_t filled, int64_t P, float *w) {
  for (int64_t t = 0; t < filled; t += WIDE) {
    const lanes8 e = exp8((load8(dots + t) - top) * scale);
    memcpy(dots + t, &e, sizeof e);
  }
  for (int64_t n = 0, t0 = 0; t0 < filled; n++, t0 += P) {
    float sum = 0.0f;
    for (int64_t t = t0; t < t0 + P && t < filled; t++) sum += dots[t];
    w[n] = sum;
  }
}

static float unrecalled_sum(float *w, int64_t pages, const uint8_t *recalled) {
  float total = 0.0f;
  for (int64_t n = 0; n < pages; n++) {
    if (recalled[n]) w[n] = 0.0f;
    total += w[n];
  }
  return total;
}

/* The largest of row[0, n) (the row padded to 8), 8 lanes at a time (larger's rule; one by one it took a third of
   a chunk's rest weights). */
static inline float row_max(const float *row, int64_t n) {
  lanes8 largest = NONE8;
  for (int64_t t = 0; t < n; t += WIDE) {
    const mask8 in = below8(t, n);
    largest = larger8(largest, (lanes8)(((mask8)load8(row + t) & in) | ((mask8)NONE8 & ~in)));
  }
  float top = -INFINITY;
  for (int l = 0; l < WIDE; l++) top = larger(top, largest[l]);
  return top;
}

static inline void scale_floats(float *v, int64_t n, float factor) {
  for (int64_t d = 0; d < n; d++) v[d] *= factor;
}

static void weigh_means(const float *w, int64_t M, int64_t pages, const uint8_t *recalled, const float *means,
                        int64_t meaned, const float *part, int64_t Dv, float *value) {
  for (int64_t m = 0; m < M; m++) {
    float *sum = value + m * Dv;
    memset(sum, 0, Dv * sizeof(float));
    for (int64_t n = 0; n < pages; n++) {
      if (recalled[n]) continue;
      const float weight = w[m * pages + n], *mean = n < meaned ? means + n * Dv : part;
      for (int64_t d = 0; d < Dv; d++) sum[d] += weight * mean[d];
    }
  }
}
