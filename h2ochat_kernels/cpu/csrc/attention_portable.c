/* The attention module for every other CPU, by GCC vector extensions: vectors of 8 floats (one AVX2 register)
   where the variant is built with -mavx2 -mfma, of 4 (one SSE register) in the generic one (8-float vectors there
   are register pairs the compiler spills: slower than torch); bf16 keys and values widened to fp32 as they are
   read. Built twice (h2ochat_kernels/cpu/variants.py): "avx2" and "generic". */

#include "vectors_portable.h"

/* LANES elements of a row of `bytes` (2: bf16, 4: fp32) from element d, as fp32 */
static inline vf widened(const char *row, int64_t d, int64_t bytes) {
  if (bytes == 4) return vload((const float *)row + d);
  vh halves;
  memcpy(&halves, (const uint16_t *)row + d, sizeof halves);
  return (vf)(__builtin_convertvector(halves, vu) << 16);
}

#include "attention_step.h"

#define QUERY_TILE 4

#if defined(__clang__)
#define PICK(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PICK(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* LANES vectors of lane sums to one vector of the LANES sums (sum j in lane j), by levels of folds: at a level of
   width w, each group of 2w lanes keeps a's w sums of pairs in its low half and b's in its high half. */
#if LANES == 8
static inline vf fold4(vf a, vf b) { return PICK(a, b, 0, 1, 2, 3, 12, 13, 14, 15) + PICK(a, b, 4, 5, 6, 7, 8, 9, 10, 11); }
static inline vf fold2(vf a, vf b) { return PICK(a, b, 0, 1, 10, 11, 4, 5, 14, 15) + PICK(a, b, 2, 3, 8, 9, 6, 7, 12, 13); }
static inline vf fold1(vf a, vf b) { return PICK(a, b, 0, 9, 2, 11, 4, 13, 6, 15) + PICK(a, b, 1, 8, 3, 10, 5, 12, 7, 14); }
static inline vf folded(const vf s[8]) {
  return fold1(fold2(fold4(s[0], s[4]), fold4(s[2], s[6])), fold2(fold4(s[1], s[5]), fold4(s[3], s[7])));
}
#else
static inline vf fold2(vf a, vf b) { return PICK(a, b, 0, 1, 6, 7) + PICK(a, b, 2, 3, 4, 5); }
static inline vf fold1(vf a, vf b) { return PICK(a, b, 0, 5, 2, 7) + PICK(a, b, 1, 4, 3, 6); }
static inline vf folded(const vf s[4]) { return fold1(fold2(s[0], s[2]), fold2(s[1], s[3])); }
#endif

/* The queries widened to fp32, zero past D. */
static int64_t prepared_bytes(int64_t bytes) { (void)bytes; return sizeof(float); } /* (fp32 whatever the dtype) */

static void prepare_queries(const char *q, int64_t G, int64_t D, int64_t bytes, float *prepared) {
  const int64_t width = value_columns(D);
  memset(prepared, 0, G * width * sizeof(float));
  for (int64_t g = 0; g < G; g++)
    for (int64_t d = 0; d < D; d++) prepared[g * width + d] = element(q + g * D * bytes, d, bytes);
}

/* q.k of GT queries (a constant once inlined) with n <= LANES keys: each key's whole chunks read once for all of them,
   lane sums folded per query; the channels past the last whole chunk added one by one. */
static inline __attribute__((always_inline)) void dots_tile(const char *keys, int64_t key_s, int64_t n,
                                                            const float *q, int64_t q_row, const int GT,
                                                            const int64_t D, int64_t bytes, float *logits,
                                                            int64_t columns) {
  const int64_t whole = D / LANES * LANES;
  vf sums[QUERY_TILE][LANES];
  for (int j = 0; j < LANES; j++) {
    vf acc[QUERY_TILE];
    for (int g = 0; g < GT; g++) acc[g] = vzero();
    if (j < n) {
      const char *key = keys + j * key_s * bytes;
      for (int64_t c = 0; c < whole; c += LANES) {
        const vf k = widened(key, c, bytes);
        for (int g = 0; g < GT; g++) acc[g] += k * vload(q + g * q_row + c);
      }
    }
    for (int g = 0; g < GT; g++) sums[g][j] = acc[g];
  }
  for (int g = 0; g < GT; g++) {
    vf dots = folded(sums[g]);
    for (int64_t j = 0; j < n && whole < D; j++)
      for (int64_t d = whole; d < D; d++) dots[j] += q[g * q_row + d] * element(keys + j * key_s * bytes, d, bytes);
    vstore(logits + g * columns, dots);
  }
}

static inline __attribute__((always_inline)) void dots_of(const char *keys, int64_t key_s, int64_t n, const float *q,
                                                          int64_t q_row, const int GT, int64_t D, int64_t bytes,
                                                          float *logits, int64_t columns) {
  if (D == 64) dots_tile(keys, key_s, n, q, q_row, GT, 64, bytes, logits, columns);
  else if (D == 128) dots_tile(keys, key_s, n, q, q_row, GT, 128, bytes, logits, columns);
  else dots_tile(keys, key_s, n, q, q_row, GT, D, bytes, logits, columns);
}

static void key_dots(const char *keys, int64_t key_s, int64_t n, const float *prepared, int64_t G, int64_t D,
                     int64_t bytes, float *logits, int64_t columns) {
  const int64_t q_row = value_columns(D);
  for (int64_t g0 = 0; g0 < G; g0 += QUERY_TILE) {
    const float *q = prepared + g0 * q_row;
    float *rows = logits + g0 * columns;
    switch (G - g0 < QUERY_TILE ? G - g0 : QUERY_TILE) {
    case 1: dots_of(keys, key_s, n, q, q_row, 1, D, bytes, rows, columns); break;
    case 2: dots_of(keys, key_s, n, q, q_row, 2, D, bytes, rows, columns); break;
    case 3: dots_of(keys, key_s, n, q, q_row, 3, D, bytes, rows, columns); break;
    default: dots_of(keys, key_s, n, q, q_row, 4, D, bytes, rows, columns); break;
    }
  }
}

/* Queries and chunks of LANES channels a value tile takes: 16 registers hold 3 x 4 sums and 4 values (AVX2), or
   2 x 4 sums and 4 values (SSE, where the compiler needs a few more of its own). */
#if defined(__AVX2__)
#define VALUE_QUERIES 3
#else
#define VALUE_QUERIES 2
#endif
#define VALUE_CHUNKS 4

/* acc[g][d0, d0 + LANES * chunks) += sum_j p[g][j] * value_j there, for GT queries (a constant) and up to
   VALUE_CHUNKS whole chunks of LANES channels, the sums in registers. */
static inline __attribute__((always_inline)) void values_tile(const char *values, int64_t value_s, int64_t n,
                                                              const float *p, int64_t columns, const int GT,
                                                              int64_t d0, int64_t chunks, int64_t bytes, float *acc,
                                                              int64_t width) {
  vf sums[QUERY_TILE][VALUE_CHUNKS];
  for (int g = 0; g < GT; g++)
    for (int c = 0; c < VALUE_CHUNKS; c++) sums[g][c] = c < chunks ? vload(acc + g * width + d0 + LANES * c) : vzero();
  for (int64_t j = 0; j < n; j++) {
    const char *value = values + j * value_s * bytes;
    vf v[VALUE_CHUNKS];
    for (int c = 0; c < VALUE_CHUNKS; c++) v[c] = c < chunks ? widened(value, d0 + LANES * c, bytes) : vzero();
    for (int g = 0; g < GT; g++) {
      const vf weight = vset1(p[g * columns + j]);
      for (int c = 0; c < VALUE_CHUNKS; c++)
        if (c < chunks) sums[g][c] += weight * v[c];
    }
  }
  for (int g = 0; g < GT; g++)
    for (int c = 0; c < VALUE_CHUNKS; c++)
      if (c < chunks) vstore(acc + g * width + d0 + LANES * c, sums[g][c]);
}

static void value_sums(const char *values, int64_t value_s, int64_t n, const float *p, int64_t columns, int64_t G,
                       int64_t D, int64_t bytes, float *acc, int64_t width) {
  const int64_t whole = D / LANES * LANES;
  for (int64_t d0 = 0; d0 < whole; d0 += LANES * VALUE_CHUNKS) {
    const int64_t chunks = (whole - d0) / LANES < VALUE_CHUNKS ? (whole - d0) / LANES : VALUE_CHUNKS;
    for (int64_t g0 = 0; g0 < G; g0 += VALUE_QUERIES) {
      const float *weights = p + g0 * columns;
      float *sums = acc + g0 * width;
      switch (G - g0 < VALUE_QUERIES ? G - g0 : VALUE_QUERIES) {
      case 1: values_tile(values, value_s, n, weights, columns, 1, d0, chunks, bytes, sums, width); break;
      case 2: values_tile(values, value_s, n, weights, columns, 2, d0, chunks, bytes, sums, width); break;
      default: values_tile(values, value_s, n, weights, columns, 3, d0, chunks, bytes, sums, width); break;
      }
    }
  }
  for (int64_t j = 0; j < n && whole < D; j++)
    for (int64_t g = 0; g < G; g++)
      for (int64_t d = whole; d < D; d++)
        acc[g * width + d] += p[g * columns + j] * element(values + j * value_s * bytes, d, bytes);
}
