/* The attention module for CPUs with AVX512-BF16: 16-lane vectors; bf16 keys dotted by VDPBF16PS (products exact,
   summed in fp32), bf16 values widened to fp32 as they are read; fp32 keys and values by FMA. Built with
   -mavx512f -mavx512bw -mavx512bf16 (h2ochat_kernels/cpu/variants.py); loaded only where the CPU has avx512_bf16. */

#include <immintrin.h>

#include "vectors_avx512.h"

#include "attention_step.h"

#define QUERY_TILE 4 /* queries whose sums a pass over a block of keys or values keeps at once */
#define WIDE_TILE 6  /* queries a pass over a block of values widened to fp32 keeps at once (24 sums in registers) */

/* The queries as the dots read them: bf16 as they are, fp32 as they are, each zero-padded to whole 32-channel
   (bf16) or 16-channel (fp32) chunks, `value_columns(D)` elements apart. */
static int64_t prepared_bytes(int64_t bytes) { return bytes; } /* (bf16 kept as bf16 for VDPBF16PS) */

static void prepare_queries(const char *q, int64_t G, int64_t D, int64_t bytes, float *prepared) {
  const int64_t width = value_columns(D);
  memset(prepared, 0, G * width * sizeof(float));
  for (int64_t g = 0; g < G; g++) memcpy((char *)prepared + g * width * bytes, q + g * D * bytes, D * bytes);
}

#include "lane_folds_avx512.h"

/* Sixteen vectors of lane sums to one vector of the sixteen sums (sum j in lane j), by four levels of folds. */
static inline vf folded(const vf s[16]) {
  vf eights[8], fours[4], twos[2];
  for (int i = 0; i < 8; i++) eights[i] = fold_256(s[i], s[i + 8]);
  for (int i = 0; i < 4; i++) fours[i] = fold_128(eights[i], eights[i + 4]);
  for (int i = 0; i < 2; i++) twos[i] = fold_64(fours[i], fours[i + 2]);
  return fold_32(twos[0], twos[1]);
}

/* q.k of GT queries (a constant once inlined) with n <= 16 keys: each key read once for all of them, lane by lane
   sums folded per query. D a constant at the common head dims (the chunk loop unrolled). */
static inline __attribute__((always_inline)) void dots_tile(const char *keys, int64_t key_s, int64_t n,
                                                            const char *q, int64_t q_row, const int GT,
                                                            const int64_t D, int64_t bytes, float *logits,
                                                            int64_t columns) {
  vf sums[QUERY_TILE][16];
  for (int j = 0; j < 16; j++) {
    vf acc[QUERY_TILE];
    for (int g = 0; g < GT; g++) acc[g] = _mm512_setzero_ps();
    if (j < n) {
      if (bytes == 2) {
        const uint16_t *key = (const uint16_t *)keys + j * key_s;
        for (int64_t c = 0; c < D; c += 32) {
          const __mmask32 live = D - c >= 32 ? 0xffffffffu : (__mmask32)((1ull << (D - c)) - 1u);
          const __m512bh k = (__m512bh)_mm512_maskz_loadu_epi16(live, key + c);
          for (int g = 0; g < GT; g++)
            acc[g] = _mm512_dpbf16_ps(acc[g], k, (__m512bh)_mm512_loadu_si512((const uint16_t *)q + g * q_row + c));
        }
      } else {
        const float *key = (const float *)keys + j * key_s;
        for (int64_t c = 0; c < D; c += 16) {
          const __mmask16 live = D - c >= 16 ? 0xffff : (__mmask16)((1u << (D - c)) - 1u);
          const vf k = _mm512_maskz_loadu_ps(live, key + c);
          for (int g = 0; g < GT; g++) acc[g] = _mm512_fmadd_ps(k, _mm512_loadu_ps((const float *)q + g * q_row + c), acc[g]);
        }
      }
    }
    for (int g = 0; g < GT; g++) sums[g][j] = acc[g];
  }
  for (int g = 0; g < GT; g++) _mm512_storeu_ps(logits + g * columns, folded(sums[g]));
}

static inline __attribute__((always_inline)) void dots_of(const char *keys, int64_t key_s, int64_t n, const char *q,
                                                          int64_t q_row, const int GT, int64_t D, int64_t bytes,
                                                          float *logits, int64_t columns) {
  if (D == 64) dots_tile(keys, key_s, n, q, q_row, GT, 64, bytes, logits, columns);
  else if (D == 128) dots_tile(keys, key_s, n, q, q_row, GT, 128, bytes, logits, columns);
  else dots_tile(keys, key_s, n, q, q_row, GT, D, bytes, logits, columns);
}

/* A prompt chunk's many query rows against bf16 keys: the block's keys laid out once as channel pairs, lane j of
   pair p holding key j's channels 2p and 2p + 1 (zero past D and past n), so that each query row's dot with all 16
   keys is one VDPBF16PS per pair with the row's pair broadcast, summed in its lane: no folds, and the keys' pairs
   are read from L1 by every tile of rows. A decode step's few rows keep the folded dots (the layout would cost more
   than it saves). */
#define PAIR_ROWS 8     /* query rows at or above which the paired dots run */
#define ROW_TILE 16     /* query rows whose 16 sums a pass over the pairs keeps in registers */

/* A prompt chunk's rows over bf16 slots: what the paired key dots and the widened value sums take. */
static inline int many_bf16_rows(int64_t bytes, int64_t rows) { return bytes == 2 && rows >= PAIR_ROWS; }

static inline int64_t pairs_of(int64_t D) { return (D + 1) / 2; }

static void key_pairs(const uint16_t *keys, int64_t key_s, int64_t n, int64_t D, uint32_t *pairs) {
  const int64_t P = pairs_of(D);
  memset(pairs, 0, P * LANES * sizeof(uint32_t));
  for (int64_t j = 0; j < n; j++) {
    const uint16_t *key = keys + j * key_s;
    for (int64_t p = 0; p < P; p++)
      pairs[p * LANES + j] = (uint32_t)key[2 * p] | (2 * p + 1 < D ? (uint32_t)key[2 * p + 1] << 16 : 0u);
  }
}

/* The dots of R query rows (a constant once inlined; rows q_row elements apart, zero past D) with the block's
   pairs: row r's 16 sums into logits + r * columns. */
static inline __attribute__((always_inline)) void pair_dots_tile(const uint32_t *pairs, const int64_t P,
                                                                 const uint16_t *q, int64_t q_row, const int R,
                                                                 float *logits, int64_t columns) {
  vf acc[ROW_TILE];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; p++) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(pairs + p * LANES);
    for (int r = 0; r < R; r++) {
      uint32_t two;
      memcpy(&two, q + r * q_row + 2 * p, sizeof two);
      acc[r] = _mm512_dpbf16_ps(acc[r], k, (__m512bh)_mm512_set1_epi32((int)two));
    }
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(logits + r * columns, acc[r]);
}

static inline __attribute__((always_inline)) void pair_dots_of(const uint32_t *pairs, int64_t D, const uint16_t *q,
                                                               int64_t q_row, const int R, float *logits,
                                                               int64_t columns) {
  if (D == 64) pair_dots_tile(pairs, 32, q, q_row, R, logits, columns);
  else if (D == 128) pair_dots_tile(pairs, 64, q, q_row, R, logits, columns);
  else pair_dots_tile(pairs, pairs_of(D), q, q_row, R, logits, columns);
}

#define PAIR_TILE_CASE(r) case r: pair_dots_of(pairs, D, q, q_row, r, rows, columns); break;

static void paired_key_dots(const char *keys, int64_t key_s, int64_t n, const float *prepared, int64_t M, int64_t D,
                            float *logits, int64_t columns) {
  const int64_t q_row = value_columns(D);
  uint32_t pairs[pairs_of(D) * LANES];
  key_pairs((const uint16_t *)keys, key_s, n, D, pairs);
  for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
    const uint16_t *q = (const uint16_t *)prepared + m0 * q_row;
    float *rows = logits + m0 * columns;
    switch (M - m0 < ROW_TILE ? M - m0 : ROW_TILE) {
      PAIR_TILE_CASE(1) PAIR_TILE_CASE(2) PAIR_TILE_CASE(3) PAIR_TILE_CASE(4) PAIR_TILE_CASE(5) PAIR_TILE_CASE(6)
      PAIR_TILE_CASE(7) PAIR_TILE_CASE(8) PAIR_TILE_CASE(9) PAIR_TILE_CASE(10) PAIR_TILE_CASE(11)
      PAIR_TILE_CASE(12) PAIR_TILE_CASE(13) PAIR_TILE_CASE(14) PAIR_TILE_CASE(15)
      default: pair_dots_of(pairs, D, q, q_row, ROW_TILE, rows, columns); break;
    }
  }
}

/* The raw q.k of every query with keys [0, n) (n <= LANES, key j at keys + j * key_s elements) into lanes [0, 16)
   of each query's logit row (lanes past n: 0). */
static void key_dots(const char *keys, int64_t key_s, int64_t n, const float *prepared, int64_t G, int64_t D,
                     int64_t bytes, float *logits, int64_t columns) {
  if (many_bf16_rows(bytes, G)) {
    paired_key_dots(keys, key_s, n, prepared, G, D, logits, columns);
    return;
  }
  const int64_t q_row = value_columns(D); /* (in elements of `bytes`) */
  for (int64_t g0 = 0; g0 < G; g0 += QUERY_TILE) {
    const char *q = (const char *)prepared + g0 * q_row * bytes;
    float *rows = logits + g0 * columns;
    switch (G - g0 < QUERY_TILE ? G - g0 : QUERY_TILE) {
    case 1: dots_of(keys, key_s, n, q, q_row, 1, D, bytes, rows, columns); break;
    case 2: dots_of(keys, key_s, n, q, q_row, 2, D, bytes, rows, columns); break;
    case 3: dots_of(keys, key_s, n, q, q_row, 3, D, bytes, rows, columns); break;
    default: dots_of(keys, key_s, n, q, q_row, 4, D, bytes, rows, columns); break;
    }
  }
}

/* 16 channels of a value from channel d (those past D: 0) as fp32. */
static inline vf value_chunk(const char *value, int64_t d, int64_t D, int64_t bytes) {
  if (bytes == 4) {
    const __mmask16 live = D - d >= 16 ? 0xffff : D <= d ? 0 : (__mmask16)((1u << (D - d)) - 1u);
    return _mm512_maskz_loadu_ps(live, (const float *)value + d);
  }
  const __mmask32 live = D - d >= 16 ? 0xffffu : D <= d ? 0 : (__mmask32)((1u << (D - d)) - 1u);
  const __m512i halves = _mm512_maskz_loadu_epi16(live, (const uint16_t *)value + d);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(halves)), 16));
}

/* acc[g][d0, d0 + 64) += sum_j p[g][j] * value_j[d0, d0 + 64) for GT queries (a constant): 16 sums in registers. */
static inline __attribute__((always_inline)) void values_tile(const char *values, int64_t value_s, int64_t n,
                                                              const float *p, int64_t columns, const int GT,
                                                              int64_t d0, int64_t D, int64_t bytes, float *acc,
                                                              int64_t width) {
  vf sums[WIDE_TILE][4];
  for (int g = 0; g < GT; g++)
    for (int c = 0; c < 4; c++) sums[g][c] = _mm512_loadu_ps(acc + g * width + d0 + 16 * c);
  for (int64_t j = 0; j < n; j++) {
    const char *value = values + j * value_s * bytes;
    vf v[4];
    for (int c = 0; c < 4; c++) v[c] = value_chunk(value, d0 + 16 * c, D, bytes);
    for (int g = 0; g < GT; g++) {
      const vf weight = _mm512_set1_ps(p[g * columns + j]);
      for (int c = 0; c < 4; c++) sums[g][c] = _mm512_fmadd_ps(weight, v[c], sums[g][c]);
    }
  }
  for (int g = 0; g < GT; g++)
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + g * width + d0 + 16 * c, sums[g][c]);
}

/* acc[g] += sum_j p[g][j] * value_j over values [0, n) (value j at values + j * value_s elements), by tiles of `tile`
   (<= WIDE_TILE) queries and 64 channels, each reading the block's values from L1 after the first. */
static void value_tiles(const char *values, int64_t value_s, int64_t n, const float *p, int64_t columns, int64_t G,
                        int64_t D, int64_t bytes, float *acc, int64_t width, const int64_t tile) {
  for (int64_t d0 = 0; d0 < D; d0 += 64)
    for (int64_t g0 = 0; g0 < G; g0 += tile) {
      const float *weights = p + g0 * columns;
      float *sums = acc + g0 * width;
      switch (G - g0 < tile ? G - g0 : tile) {
      case 1: values_tile(values, value_s, n, weights, columns, 1, d0, D, bytes, sums, width); break;
      case 2: values_tile(values, value_s, n, weights, columns, 2, d0, D, bytes, sums, width); break;
      case 3: values_tile(values, value_s, n, weights, columns, 3, d0, D, bytes, sums, width); break;
      case 4: values_tile(values, value_s, n, weights, columns, 4, d0, D, bytes, sums, width); break;
      case 5: values_tile(values, value_s, n, weights, columns, 5, d0, D, bytes, sums, width); break;
      default: values_tile(values, value_s, n, weights, columns, 6, d0, D, bytes, sums, width); break;
      }
    }
}

static void value_sums(const char *values, int64_t value_s, int64_t n, const float *p, int64_t columns, int64_t G,
                       int64_t D, int64_t bytes, float *acc, int64_t width) {
  if (!many_bf16_rows(bytes, G)) {
    value_tiles(values, value_s, n, p, columns, G, D, bytes, acc, width, QUERY_TILE);
    return;
  }
  /* a chunk's many rows: the block's bf16 values widened to fp32 once, not per tile, so that no conversion is left
     in the loop and a tile can keep more sums (WIDE_TILE) */
  float wide[n * width];
  for (int64_t j = 0; j < n; j++)
    for (int64_t d = 0; d < width; d += 16)
      _mm512_storeu_ps(wide + j * width + d, value_chunk(values + j * value_s * bytes, d, D, bytes));
  value_tiles((const char *)wide, width, n, p, columns, G, D, 4, acc, width, WIDE_TILE);
}
