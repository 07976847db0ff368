/* Page scores of bf16 queries and keys by VDPBF16PS (the avx512bf16 variant only): products exact in fp32,
   summed in fp32. Up to DECODE_QUERIES queries (a decode step's group) go 16 keys at a time, key by key for
   all the queries, the per-key sums added across lanes by folds (few_page_scores); more (a prompt chunk's)
   by blocks of keys laid out by channel pairs (many_page_scores), near one VDPBF16PS a cycle. */

#pragma once

#define LOAD(p) ((__m512bh)_mm512_loadu_si512(p))
#define LOAD_MASKED(mask, p) ((__m512bh)_mm512_maskz_loadu_epi16((mask), (p)))

/* sum[m] = q_m . key for the M queries (D bf16 each, q_m at q + m * D): each of the key's 32-channel
   chunks read once for all of them, 16 lanes of channel-pair products to add across lanes. */
static inline __attribute__((always_inline)) void key_sums(const uint16_t *key, const uint16_t *q, const int M,
                                                           const int64_t D, __m512 *sum) {
  const int64_t full = D / 32;
  const __mmask32 tail = (__mmask32)((1ull << (D % 32)) - 1u);
  for (int m = 0; m < M; m++) sum[m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < full; c++) {
    const __m512bh k = LOAD(key + c * 32);
    for (int m = 0; m < M; m++) sum[m] = _mm512_dpbf16_ps(sum[m], k, LOAD(q + m * D + c * 32));
  }
  if (tail) {
    const __m512bh k = LOAD_MASKED(tail, key + full * 32);
    for (int m = 0; m < M; m++) sum[m] = _mm512_dpbf16_ps(sum[m], k, LOAD_MASKED(tail, q + m * D + full * 32));
  }
}

#include "lane_folds_avx512.h" /* fold_256 ... fold_32 */

/* The best q.k over M <= FEW_QUERIES queries of each of KEY_BLOCK keys (key j at first + j * key_t),
   lane j key j. Key by key, each read once for every query (its loads spread through the block's work,
   so the next keys' loads go out while this block's sums are folded: 1.1-1.4x each query over the block
   in turn, with the keys from memory), each pair's sums folded as they come; the folds leave key j in
   the lane of j's 4 bits reversed, put back at the end.
   M and D constants (keys_best's): the queries' sums stay in registers, D's chunks unrolled. */
static inline __attribute__((always_inline)) __m512 group_best(const uint16_t *first, int64_t key_t,
                                                               const uint16_t *q, const int M, const int64_t D,
                                                               float *dots, int64_t dot_stride) {
  __m512 pair[FEW_QUERIES][2], quad[FEW_QUERIES][2], octet[FEW_QUERIES][2];
  const uint16_t *key = first;
#pragma GCC unroll 8
  for (int p = 0; p < KEY_BLOCK / 2; p++, key += 2 * key_t) {
    __m512 a[FEW_QUERIES], b[FEW_QUERIES];
    key_sums(key, q, M, D, a);
    key_sums(key + key_t, q, M, D, b);
    for (int m = 0; m < M; m++) pair[m][p & 1] = fold_256(a[m], b[m]);
    if (p % 2 == 1)
      for (int m = 0; m < M; m++) quad[m][p / 2 % 2] = fold_128(pair[m][0], pair[m][1]);
    if (p % 4 == 3)
      for (int m = 0; m < M; m++) octet[m][p / 4] = fold_64(quad[m][0], quad[m][1]);
  }
  __m512 best = _mm512_set1_ps(-INFINITY);
  const __m512i reversed = _mm512_set_epi32(15, 7, 11, 3, 13, 5, 9, 1, 14, 6, 10, 2, 12, 4, 8, 0);
  for (int m = 0; m < M; m++) {
    const __m512 sums = fold_32(octet[m][0], octet[m][1]);
    best = _mm512_max_ps(best, sums);
    if (dots) _mm512_storeu_ps(dots + m * dot_stride, _mm512_permutexvar_ps(reversed, sums));
  }
  return _mm512_permutexvar_ps(reversed, best);
}

/* group_best for M queries as a constant, D as one at head dims 64 and 128 (without: ~1.2x slower). */
static inline __attribute__((always_inline)) __m512 group_of(const uint16_t *first, int64_t key_t,
                                                             const uint16_t *q, const int M, int64_t D,
                                                             float *dots, int64_t dot_stride) {
  if (D == 64) return group_best(first, key_t, q, M, 64, dots, dot_stride);
  if (D == 128) return group_best(first, key_t, q, M, 128, dots, dot_stride);
  return group_best(first, key_t, q, M, D, dots, dot_stride);
}

/* The best q.k over M queries (any number: groups of FEW_QUERIES) of each of KEY_BLOCK keys, lane j key j;
   dots (NULL: not kept): every query's 16 sums too, query m's at dots + m * dot_stride (the rest's). */
static __m512 keys_best(const uint16_t *first, int64_t key_t, const uint16_t *q, int64_t M, int64_t D, float *dots,
                        int64_t dot_stride) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  for (int64_t m = 0; m < M; m += FEW_QUERIES) {
    const uint16_t *group = q + m * D;
    float *kept = dots ? dots + m * dot_stride : NULL;
    __m512 top;
    switch (M - m < FEW_QUERIES ? M - m : FEW_QUERIES) {
    case 1: top = group_of(first, key_t, group, 1, D, kept, dot_stride); break;
    case 2: top = group_of(first, key_t, group, 2, D, kept, dot_stride); break;
    case 3: top = group_of(first, key_t, group, 3, D, kept, dot_stride); break;
    case 4: top = group_of(first, key_t, group, 4, D, kept, dot_stride); break;
    case 5: top = group_of(first, key_t, group, 5, D, kept, dot_stride); break;
    default: top = group_of(first, key_t, group, FEW_QUERIES, D, kept, dot_stride); break;
    }
    best = _mm512_max_ps(best, top);
  }
  return best;
}

/* Asks for a block's keys (KEY_BLOCK from first) a block ahead: block_pairs' strided loads leave the
   hardware's prefetchers behind (1.6x at 8 queries over 2K keys a row from the L3; few_page_scores'
   key-by-key loads do not: slower with it). */
static inline void prefetch_block(const uint16_t *first, int64_t key_t, int64_t D) {
  for (int j = 0; j < KEY_BLOCK; j++)
    for (int64_t c = 0; c < D; c += 32) _mm_prefetch((const char *)(first + j * key_t + c), _MM_HINT_T0);
}

/* The lanes of a block of n keys from slot t0 that are valid (valid NULL: all n). */
static inline __mmask16 live_lanes(const uint8_t *valid, int64_t t0, int64_t n) {
  const __mmask16 lanes = (__mmask16)((1u << n) - 1u);
  if (!valid) return lanes;
  const __m512i bytes = _mm512_maskz_loadu_epi8((__mmask64)lanes, valid + t0);
  return (__mmask16)_mm512_test_epi8_mask(bytes, bytes);
}

/* Raises the scores of the pages a block of n keys from slot t0 falls in to the best of their live lanes:
   a whole block of pages of 8 or 16 (the usual; blocks start at multiples of 16) by one tree of maxima
   (lanes 0 and 8, or 0), else each page's lanes by a masked maximum. */
static inline void raise_pages(__m512 best, __mmask16 live, int64_t t0, int64_t n, int64_t page, float *scores) {
  if (n == KEY_BLOCK && (page == 8 || page == 16)) {
    __m512 top = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, best);
    top = _mm512_max_ps(top, _mm512_permute_ps(top, 0xb1));
    top = _mm512_max_ps(top, _mm512_permute_ps(top, 0x4e));
    top = _mm512_max_ps(top, _mm512_shuffle_f32x4(top, top, 0xb1));
    if (page == 16) top = _mm512_max_ps(top, _mm512_shuffle_f32x4(top, top, 0x4e));
    float *score = scores + t0 / page;
    score[0] = larger(score[0], _mm512_cvtss_f32(top));
    if (page == 8) score[1] = larger(score[1], _mm_cvtss_f32(_mm512_extractf32x4_ps(top, 2)));
    return;
  }
  for (int64_t first = t0, last; first < t0 + n; first = last) {
    const int64_t at = first / page;
    last = (at + 1) * page < t0 + n ? (at + 1) * page : t0 + n;
    const __mmask16 lanes = (__mmask16)(((1u << (last - t0)) - 1u) & ~((1u << (first - t0)) - 1u)) & live;
    if (lanes) scores[at] = larger(scores[at], _mm512_mask_reduce_max_ps(lanes, best));
  }
}

/* Raises scores[n] (page n of `page` slots from keys[0]) to the best q.k over M queries of each valid slot
   below `filled` (valid NULL: all are), KEY_BLOCK keys at a time, read where they are (a last block of
   fewer: from a zero-padded copy). Any M: the route for few queries, and the many's where memory runs out.
   dots (NULL: not kept): every q.k too, query m's of slot t at dots[m * dot_stride + t] (a last block's 16
   written whole: the rows are padded). */
static void few_page_scores(const uint16_t *q, int64_t M, int64_t D, const uint16_t *keys, int64_t key_t,
                            const uint8_t *valid, int64_t filled, int64_t page, float *scores, float *dots,
                            int64_t dot_stride) {
  for (int64_t t0 = 0; t0 < filled; t0 += KEY_BLOCK) {
    const int64_t n = filled - t0 < KEY_BLOCK ? filled - t0 : KEY_BLOCK;
    const __mmask16 live = live_lanes(valid, t0, n);
    float *kept = dots ? dots + t0 : NULL;
    if (!live) continue;
    if (n == KEY_BLOCK) {
      raise_pages(keys_best(keys + t0 * key_t, key_t, q, M, D, kept, dot_stride), live, t0, n, page, scores);
      continue;
    }
    uint16_t copy[KEY_BLOCK * D];
    memset(copy, 0, sizeof copy);
    for (int64_t j = 0; j < n; j++) memcpy(copy + j * D, keys + (t0 + j) * key_t, D * sizeof(uint16_t));
    raise_pages(keys_best(copy, D, q, M, D, kept, dot_stride), live, t0, n, page, scores);
  }
}

#define QUERY_GROUP 8 /* queries a pass over a block: independent VDPBF16PS chains to cover its latency */

/* A block's n <= KEY_BLOCK keys (key j at first + j * key_t) by channel pairs: block[p * KEY_BLOCK + j] =
   key j's channels 2p, 2p + 1 (32 bits, as VDPBF16PS pairs them; an odd D's last pair: its last channel and
   0; absent keys: 0), for p up to D2 rounded up to 16. 32 channels of each key are one 16 x 16 transpose of
   32-bit pairs (unpacks within 128-bit lanes, then lane shuffles): ~3x faster than pair by pair. */
static void block_pairs(const uint16_t *first, int64_t key_t, int64_t n, int64_t D, uint32_t *block) {
  for (int64_t c = 0; c < D; c += 32) {
    const __mmask32 mask = D - c >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (D - c)) - 1u);
    __m512i r[KEY_BLOCK], t[KEY_BLOCK];
    for (int j = 0; j < KEY_BLOCK; j++)
      r[j] = j < n ? _mm512_maskz_loadu_epi16(mask, first + j * key_t + c) : _mm512_setzero_si512();
    for (int j = 0; j < KEY_BLOCK; j += 2) {
      t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
      t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
    }
    /* r[4g + e], 128-bit lane L: pair 4L + e of keys 4g .. 4g + 3 */
    for (int j = 0; j < KEY_BLOCK; j += 4) {
      r[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
      r[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
      r[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
      r[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
    }
    for (int e = 0; e < 4; e++) {
      const __m512i x0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), x1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xee);
      const __m512i y0 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
      const __m512i y1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xee);
      uint32_t *out = block + (c / 2 + e) * KEY_BLOCK;
      _mm512_storeu_si512(out, _mm512_shuffle_i32x4(x0, y0, 0x88));
      _mm512_storeu_si512(out + 4 * KEY_BLOCK, _mm512_shuffle_i32x4(x0, y0, 0xdd));
      _mm512_storeu_si512(out + 8 * KEY_BLOCK, _mm512_shuffle_i32x4(x1, y1, 0x88));
      _mm512_storeu_si512(out + 12 * KEY_BLOCK, _mm512_shuffle_i32x4(x1, y1, 0xdd));
    }
  }
}

/* The best q.k over every query of each of a block's keys: block [D2][KEY_BLOCK] (the keys' channel
   pairs, lane j key j), pairs [rows][D2] (the queries' pairs). No horizontal sum: each lane is one key's dot.
   dots (NULL: not kept): the first M queries' 16 dots too, query m's at dots + m * dot_stride. */
static inline __m512 block_best(const uint32_t *block, const uint32_t *pairs, int64_t rows, int64_t D2, int64_t M,
                                float *dots, int64_t dot_stride) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  for (int64_t m = 0; m < rows; m += QUERY_GROUP) {
    const uint32_t *group = pairs + m * D2;
    __m512 acc[QUERY_GROUP];
    for (int i = 0; i < QUERY_GROUP; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D2; p++) {
      const __m512bh k = LOAD(block + p * KEY_BLOCK);
      for (int i = 0; i < QUERY_GROUP; i++)
        acc[i] = _mm512_dpbf16_ps(acc[i], k, (__m512bh)_mm512_set1_epi32((int)group[i * D2 + p]));
    }
    for (int i = 0; i < QUERY_GROUP; i++) best = _mm512_max_ps(best, acc[i]);
    if (dots)
      for (int i = 0; i < QUERY_GROUP && m + i < M; i++) _mm512_storeu_ps(dots + (m + i) * dot_stride, acc[i]);
  }
  return best;
}

/* few_page_scores' work for M > DECODE_QUERIES: keys are taken KEY_BLOCK at a time, laid out by channel
   pairs once (L1-resident), and every query passes over them (a prompt chunk's rest keeps their q.k: dots, as
   few_page_scores keeps them; each query's by channel pairs in order, not folded across lanes). 0 where memory
   runs out (scores untouched). */
static int many_page_scores(const uint16_t *q, int64_t M, int64_t D, const uint16_t *keys, int64_t key_t,
                            const uint8_t *valid, int64_t filled, int64_t page, float *scores, float *dots,
                            int64_t dot_stride) {
  const int64_t D2 = (D + 1) / 2, rows = (M + QUERY_GROUP - 1) / QUERY_GROUP * QUERY_GROUP;
  /* one allocation: the queries' pairs, a block's pairs */
  uint32_t *pairs = malloc((rows * D2 + KEY_BLOCK * ((D2 + 15) / 16 * 16)) * sizeof(uint32_t));
  if (!pairs) return 0;
  uint32_t *block = pairs + rows * D2;
  for (int64_t m = 0; m < rows; m++) { /* the last query repeated up to a whole group: no maximum moves */
    pairs[m * D2 + D2 - 1] = 0; /* (an odd D's last pair: its channel and 0) */
    memcpy(pairs + m * D2, q + (m < M ? m : M - 1) * D, D * sizeof(uint16_t));
  }
  for (int64_t t0 = 0; t0 < filled; t0 += KEY_BLOCK) {
    const int64_t n = filled - t0 < KEY_BLOCK ? filled - t0 : KEY_BLOCK;
    const __mmask16 live = live_lanes(valid, t0, n);
    if (!live) continue;
    if (t0 + 2 * KEY_BLOCK <= filled) prefetch_block(keys + (t0 + KEY_BLOCK) * key_t, key_t, D);
    block_pairs(keys + t0 * key_t, key_t, n, D, block); /* (a tail's absent keys: lanes never read) */
    raise_pages(block_best(block, pairs, rows, D2, M, dots ? dots + t0 : NULL, dot_stride), live, t0, n, page, scores);
  }
  free(pairs);
  return 1;
}

/* Raises scores[n] to the best q.k of these M queries over page n's valid slots: by few_page_scores up to
   DECODE_QUERIES queries, by many_page_scores from there (few_page_scores where its memory runs out); dots as both
   keep them (NULL: not kept). */
static void raise_page_scores(const uint16_t *q, int64_t M, int64_t D, const uint16_t *keys, int64_t key_t,
                              const uint8_t *valid, int64_t filled, int64_t page, float *scores, float *dots,
                              int64_t dot_stride) {
  if (M <= DECODE_QUERIES || !many_page_scores(q, M, D, keys, key_t, valid, filled, page, scores, dots, dot_stride))
    few_page_scores(q, M, D, keys, key_t, valid, filled, page, scores, dots, dot_stride);
}
