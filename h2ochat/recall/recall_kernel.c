/* The recall step's host-side work for a CPU whose cold store is in the step's memory.

   Two builds of this one file (native.py picks by the CPU): with AVX512-BF16 (BF16_DOTS below), and a
   portable one (AVX2 and FMA where the CPU has them, else the compiler's baseline) for every other CPU. Both
   do everything here for bf16 and fp32; only the first has the bf16 dot products by VDPBF16PS and 16-lane
   exps and sums for the rest of the cold pages (h2ochat_bf16_dots says which build this is).

   Page scores (the exact selector's, recall_reference.page_scores with the keys themselves, bits None):
   for each (sequence b, KV head h) and page n of `page` slots,
     out[b, h, n] = max over valid slots t of the page, over queries m, of sum_d q[b, h, m, d] * k[b, h, t, d]
   (-inf where the page has no valid slot), the sums in fp32: the torch reference's up to the order they
   are added in. Queries and keys are bf16 (elements of 2 bytes) or fp32 (4), both of one dtype.
   - bf16 with BF16_DOTS: products exact in fp32, summed by VDPBF16PS. Up to DECODE_QUERIES queries (a decode
     step's group) go 16 keys at a time, key by key for all the queries, the per-key sums added across lanes
     by folds for the 16 (few_page_scores); more (a prompt chunk's hundreds or thousands) go by blocks of keys
     laid out by channel pairs (many_page_scores), near one VDPBF16PS a cycle.
   - otherwise (fp32 anywhere, bf16 in the portable build): portable C over vectors of 8 floats
     (any_raise_scores): a few queries 8 keys at a time, their sums folded (bf16 keys split into two vectors
     of fp32 as they are read, pair_few_scores; fp32 keys read in place); more by blocks of 8 keys laid out by
     channel (bf16 widened).

   Keys are read where the store keeps them: [B, H, T, D] with any strides but a unit one along D (the
   store's leading slots, a view). Queries [B, H, M, D] and valid [B, H, T] (bytes) contiguous.

   Built and loaded by native.py (through native_build's builder). */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_DOTS 1
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KEY_BLOCK 16  /* keys a block: one fp32 lane each */
/* Queries few_page_scores keeps in registers at once (a group; more go group by group, each query's sums
   in the same order whatever the grouping). */
#define FEW_QUERIES 6
/* Up to this many queries (a decode step's group of query heads per KV head on every model family) the
   page scores are the largest of each query's alone, bit for bit, in both builds: few_page_scores here,
   any_few_scores in the portable one (WIDE_KEYS). Beyond it, a prompt chunk's many go by blocks, whose sums
   are added in another order. */
#define DECODE_QUERIES 8

static inline float larger(float a, float b) { return b > a ? b : a; } /* (fmaxf: a libm call, NaN rules) */

/* x as bf16, rounded to nearest even (VCVTNEPS2BF16's and torch's); a NaN stays a quiet NaN, as VCVTNEPS2BF16 keeps
   it (rounding its bits would carry a large payload into the sign: -0). */
static inline uint16_t to_bf16(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Element i of a row of bf16 (bytes 2) or fp32 (4) values, as fp32. */
static inline float widened(const void *row, int64_t i, int64_t bytes) {
  if (bytes == 4) return ((const float *)row)[i];
  const uint32_t bits = (uint32_t)((const uint16_t *)row)[i] << 16;
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

/* n floats from `from` (elements of from_bytes: 2 bf16, 4 fp32) to `to` (to_bytes): copied, widened exactly,
   or rounded to bf16 as torch's .to(torch.bfloat16) does (a store of bf16 keys for an fp32 model's slots). */
static inline void copy_floats(void *to, int64_t to_bytes, const void *from, int64_t from_bytes, int64_t n) {
  if (to_bytes == from_bytes) {
    memcpy(to, from, n * to_bytes);
  } else if (to_bytes == 4) {
    for (int64_t d = 0; d < n; d++) ((float *)to)[d] = widened(from, d, 2);
  } else {
    for (int64_t d = 0; d < n; d++) ((uint16_t *)to)[d] = to_bf16(((const float *)from)[d]);
  }
}

/* 1 where this build has the bf16 dot products by VDPBF16PS (BF16_DOTS), 0 where not. */
int64_t h2ochat_bf16_dots(void) {
#ifdef BF16_DOTS
  return 1;
#else
  return 0;
#endif
}

#ifdef BF16_DOTS
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

#endif /* BF16_DOTS */

/* ---- Page scores over any float keys, portable: vectors of 8 fp32 lanes (one AVX2 register) ---- */

typedef float lanes8 __attribute__((vector_size(32)));
typedef int32_t mask8 __attribute__((vector_size(32))); /* (a lanes8 comparison's lanes: -1 or 0) */
#define WIDE 8       /* lanes of a lanes8 */
#define WIDE_KEYS 8  /* keys a block: one lane each */
#define BLOCK_KEYS 16 /* keys a block of any_many_scores: two vectors, one lane a key */
#define MANY_GROUP 6  /* queries a pass over such a block takes at once (12 sums: an FMA's latency covered, and 8
                         loads for 12 FMAs where 8 keys by 8 queries took 9 for 8: ~1.25x faster) */
#define PREFETCH_KEYS 16 /* the few-query routes ask for the keys this far ahead (the store read front to back) */

/* D values of `bytes` each as fp32 into out[0, Dw) (Dw: D rounded up to WIDE), zeros past D. */
static inline void widen_row(const void *row, int64_t D, int64_t Dw, int64_t bytes, float *out) {
  if (bytes == 4) memcpy(out, row, D * sizeof(float));
  else
    for (int64_t d = 0; d < D; d++) out[d] = widened(row, d, 2);
  for (int64_t d = D; d < Dw; d++) out[d] = 0.0f;
}

static inline lanes8 load8(const float *p) {
  lanes8 v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* Lanes of a and b (0-7 a's, 8-15 b's) picked by eight constant indices: GCC's or Clang's builtin. */
#if defined(__clang__)
#define PICK(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shufflevector(a, b, i0, i1, i2, i3, i4, i5, i6, i7)
#else
#define PICK(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shuffle(a, b, (mask8){i0, i1, i2, i3, i4, i5, i6, i7})
#endif

/* Two vectors of lane sums folded into one of half as many: a's in some lanes, b's in the others, each
   the sum of two of its lanes. Three levels take 8 keys' vectors to one lane a key (bit-reversed order:
   lane l holds key FOLDED[l]), 7 folds for the 8 where a horizontal sum each takes ~3 shuffles and 3 adds. */
static inline lanes8 fold_halves(lanes8 a, lanes8 b) {
  return PICK(a, b, 0, 1, 2, 3, 12, 13, 14, 15) + PICK(a, b, 4, 5, 6, 7, 8, 9, 10, 11);
}
static inline lanes8 fold_pairs(lanes8 a, lanes8 b) {
  return PICK(a, b, 0, 1, 10, 11, 4, 5, 14, 15) + PICK(a, b, 2, 3, 8, 9, 6, 7, 12, 13);
}
static inline lanes8 fold_lanes(lanes8 a, lanes8 b) {
  return PICK(a, b, 0, 9, 2, 11, 4, 13, 6, 15) + PICK(a, b, 1, 8, 3, 10, 5, 12, 7, 14);
}
static const int FOLDED[WIDE_KEYS] = {0, 4, 2, 6, 1, 5, 3, 7}, IN_ORDER[WIDE_KEYS] = {0, 1, 2, 3, 4, 5, 6, 7};

/* Raises the scores of the pages a block of n <= 8 keys from slot t0 (a multiple of 8) falls in to the best of
   their valid lanes (key lane_key[l] in lane l): a block inside one page (pages of a multiple of 8) by one
   maximum, else lane by lane. */
static inline void raise_block(float *scores, lanes8 best, const int *lane_key, int64_t t0, int64_t n,
                               const uint8_t *valid, int64_t page) {
  const int one_page = page % WIDE_KEYS == 0;
  float top = -INFINITY;
  for (int l = 0; l < WIDE_KEYS; l++) {
    const int64_t t = t0 + lane_key[l];
    if (t - t0 >= n || (valid && !valid[t])) continue;
    if (one_page) top = larger(top, best[l]);
    else scores[t / page] = larger(scores[t / page], best[l]);
  }
  if (one_page) scores[t0 / page] = larger(scores[t0 / page], top);
}

static const lanes8 NONE8 = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};

/* The larger of a and b lane by lane (larger's rule: a NaN in b keeps a). */
static inline lanes8 larger8(lanes8 a, lanes8 b) {
  const mask8 above = b > a;
  return (lanes8)(((mask8)b & above) | ((mask8)a & ~above));
}

/* One query's dots with 8 keys from their lane sums (sum[j]: key j's), folded to one lane a key (key FOLDED[l] in
   lane l); best raised to them, and kept (NULL: not kept) at kept[j] for key j. */
static inline lanes8 folded_best(lanes8 best, const lanes8 sum[WIDE_KEYS], float *kept) {
  const lanes8 dots = fold_lanes(fold_pairs(fold_halves(sum[0], sum[1]), fold_halves(sum[2], sum[3])),
                                 fold_pairs(fold_halves(sum[4], sum[5]), fold_halves(sum[6], sum[7])));
  if (kept)
    for (int l = 0; l < WIDE_KEYS; l++) kept[FOLDED[l]] = dots[l];
  return larger8(best, dots);
}

/* The best q.k over M queries (widened, qw [M][Dw]) of 8 keys (fp32, key j at k[j], Dw channels each), key
   FOLDED[l] in lane l: each query's 8 dots by lanes of channels, then folded. kept (NULL: not kept): every
   query's 8 dots too, query m's of key j at kept[m * dot_stride + j]. */
static inline lanes8 best_dots(const float *qw, int64_t M, int64_t Dw, const float *const k[WIDE_KEYS], float *kept,
                               int64_t dot_stride) {
  lanes8 best;
  for (int j = 0; j < WIDE_KEYS; j++) best[j] = -INFINITY;
  for (int64_t m = 0; m < M; m++) {
    const float *q = qw + m * Dw;
    lanes8 sum[WIDE_KEYS];
    for (int j = 0; j < WIDE_KEYS; j++) sum[j] = load8(q) * load8(k[j]);
    for (int64_t d = WIDE; d < Dw; d += WIDE) {
      const lanes8 channels = load8(q + d);
      for (int j = 0; j < WIDE_KEYS; j++) sum[j] += channels * load8(k[j] + d);
    }
    best = folded_best(best, sum, kept ? kept + m * dot_stride : NULL);
  }
  return best;
}

/* Few fp32 queries (widened, qw [M][Dw]): keys 8 at a time, each read in place (fp32, D a multiple of WIDE) or
   widened once for all the queries (absent keys: zeros, never read back), dotted with every query; their best
   raise their pages. Keys read in place ask for the keys PREFETCH_KEYS ahead as these are scored (a decode step's
   store comes from memory: 1.05-1.5x faster at 512-2K fp32 keys a row, 8 rows; benchmarks/page_scores_chunk.py
   --decode). bf16 keys take pair_few_scores instead, so the keys here are fp32. dots: as any_raise_scores keeps them. */
static void any_few_scores(const float *qw, int64_t M, int64_t D, int64_t Dw, const float *keys, int64_t key_t,
                           const uint8_t *valid, int64_t filled, int64_t page, float *scores, float *dots,
                           int64_t dot_stride) {
  float widened_keys[WIDE_KEYS * Dw];
  const int in_place = D == Dw;
  for (int64_t t0 = 0; t0 < filled; t0 += WIDE_KEYS) {
    const int64_t n = filled - t0 < WIDE_KEYS ? filled - t0 : WIDE_KEYS;
    const float *k[WIDE_KEYS];
    int live = 0;
    for (int64_t j = 0; j < WIDE_KEYS; j++) {
      const int present = j < n && (!valid || valid[t0 + j]);
      live |= present;
      const float *key = j < n ? keys + (t0 + j) * key_t : NULL;
      if (in_place && key) {
        k[j] = key;
        continue;
      }
      k[j] = widened_keys + j * Dw;
      if (key) widen_row(key, D, Dw, 4, widened_keys + j * Dw);
      else memset(widened_keys + j * Dw, 0, Dw * sizeof(float));
    }
    if (!live) continue;
    if (in_place) { /* (past the end: a hint only) */
      const char *ahead = (const char *)(keys + (t0 + PREFETCH_KEYS) * key_t);
      for (int64_t a = 0; a < WIDE_KEYS * D * (int64_t)sizeof(float); a += 64) __builtin_prefetch(ahead + a);
    }
    raise_block(scores, best_dots(qw, M, Dw, k, dots ? dots + t0 : NULL, dot_stride), FOLDED, t0, n, valid, page);
  }
}

/* ---- A few bf16 queries against bf16 keys, portable: each key's channels split in place ---- */

typedef uint32_t bits8 __attribute__((vector_size(32)));
#define PAIR_CHUNK 16 /* bf16 channels one 32-byte load of a key holds: 8 lanes of two channels each */

/* The queries (M rows of D bf16) as fp32, each 16-channel chunk as split_chunk leaves a key's: its 8 even
   channels, then its 8 odd ones; zeros past D (Dp: D rounded up to PAIR_CHUNK). */
static void split_queries(const uint16_t *q, int64_t M, int64_t D, int64_t Dp, float *split) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t d = 0; d < Dp; d++) {
      const int64_t at = m * Dp + d / PAIR_CHUNK * PAIR_CHUNK + (d % 2) * WIDE + d % PAIR_CHUNK / 2;
      split[at] = d < D ? widened(q + m * D, d, 2) : 0.0f;
    }
}

/* A key's 16 bf16 channels from p as two vectors of fp32 without a shuffle: each 32-bit lane holds channels 2l
   (low half) and 2l + 1 (high half); shifted up, the low one is an fp32, masked, the high one is. */
static inline void split_chunk(const uint16_t *p, lanes8 *even, lanes8 *odd) {
  bits8 v;
  memcpy(&v, p, sizeof v);
  *even = (lanes8)(v << 16);
  *odd = (lanes8)(v & 0xffff0000u);
}

/* The sums of G keys (key j's chunks at k[j], Dp channels) with M queries (split_queries'), acc[j][m] holding the
   8 lane sums of key j and query m: chunk by chunk, even channels then odd, one FMA chain a (key, query), so
   every (key, query) is summed in the same order whatever M and G. M and G constants (pair_best's). */
static inline __attribute__((always_inline)) void pair_sums(const float *qs, const int M, const int64_t Dp,
                                                            const uint16_t *const *k, const int G, lanes8 *acc) {
  for (int i = 0; i < G * M; i++) acc[i] = (lanes8){0};
#pragma GCC unroll 8
  for (int64_t c = 0; c < Dp; c += PAIR_CHUNK)
    for (int j = 0; j < G; j++) {
      lanes8 even, odd;
      split_chunk(k[j] + c, &even, &odd);
      for (int m = 0; m < M; m++) {
        const float *q = qs + m * Dp + c;
        acc[j * M + m] += even * load8(q);
        acc[j * M + m] += odd * load8(q + WIDE);
      }
    }
}

#define PAIR_SUMS 12 /* (key, query) sums pair_best keeps at a time: enough FMA chains to cover their latency, few
                        enough for AVX2's 16 registers with a key's two vectors and the mask */

/* best_dots for bf16 keys read in place (key j's Dp channels at k[j]): 8 keys in groups of G (G * M <= PAIR_SUMS),
   then each query's 8 folded. */
static inline __attribute__((always_inline)) lanes8 pair_best(const float *qs, const int M, const int64_t Dp,
                                                              const uint16_t *const k[WIDE_KEYS], float *kept,
                                                              int64_t dot_stride) {
  const int G = M == 1 ? 8 : M <= 3 ? 4 : M <= 6 ? 2 : 1;
  lanes8 sums[WIDE_KEYS * WIDE_KEYS], best = NONE8;
  for (int g = 0; g < WIDE_KEYS; g += G) {
    lanes8 acc[PAIR_SUMS];
    pair_sums(qs, M, Dp, k + g, G, acc);
    for (int j = 0; j < G; j++)
      for (int m = 0; m < M; m++) sums[m * WIDE_KEYS + g + j] = acc[j * M + m];
  }
  for (int m = 0; m < M; m++) {
    best = folded_best(best, sums + m * WIDE_KEYS, kept ? kept + m * dot_stride : NULL);
  }
  return best;
}

/* pair_best with Dp as a constant at head dims 64 and 128. */
static inline __attribute__((always_inline)) lanes8 pair_best_dim(const float *qs, const int M, int64_t Dp,
                                                                  const uint16_t *const k[WIDE_KEYS], float *kept,
                                                                  int64_t dot_stride) {
  if (Dp == 64) return pair_best(qs, M, 64, k, kept, dot_stride);
  if (Dp == 128) return pair_best(qs, M, 128, k, kept, dot_stride);
  return pair_best(qs, M, Dp, k, kept, dot_stride);
}

/* pair_best with M as a constant (1 to WIDE_KEYS). */
static lanes8 pair_best_of(const float *qs, int64_t M, int64_t Dp, const uint16_t *const k[WIDE_KEYS], float *kept,
                           int64_t dot_stride) {
  switch (M) {
  case 1: return pair_best_dim(qs, 1, Dp, k, kept, dot_stride);
  case 2: return pair_best_dim(qs, 2, Dp, k, kept, dot_stride);
  case 3: return pair_best_dim(qs, 3, Dp, k, kept, dot_stride);
  case 4: return pair_best_dim(qs, 4, Dp, k, kept, dot_stride);
  case 5: return pair_best_dim(qs, 5, Dp, k, kept, dot_stride);
  case 6: return pair_best_dim(qs, 6, Dp, k, kept, dot_stride);
  case 7: return pair_best_dim(qs, 7, Dp, k, kept, dot_stride);
  default: return pair_best_dim(qs, 8, Dp, k, kept, dot_stride);
  }
}

/* Few bf16 queries (split, qs [M][Dp]) against bf16 keys: 8 keys at a time, each read where it is (a key of D
   not a multiple of PAIR_CHUNK, or an absent one: from a zero-padded copy), split as it is read, and summed
   for every query; their best raise their pages. Keys read in place ask for those PREFETCH_KEYS ahead (1.1-1.2x
   from memory: benchmarks/decode_choice_kernel.c). dots: as any_raise_scores keeps them. */
static void pair_few_scores(const float *qs, int64_t M, int64_t D, int64_t Dp, const uint16_t *keys, int64_t key_t,
                            const uint8_t *valid, int64_t filled, int64_t page, float *scores, float *dots,
                            int64_t dot_stride) {
  uint16_t padded[WIDE_KEYS * Dp];
  memset(padded, 0, sizeof padded);
  for (int64_t t0 = 0; t0 < filled; t0 += WIDE_KEYS) {
    const int64_t n = filled - t0 < WIDE_KEYS ? filled - t0 : WIDE_KEYS;
    const uint16_t *k[WIDE_KEYS];
    int live = 0;
    for (int64_t j = 0; j < WIDE_KEYS; j++) {
      live |= j < n && (!valid || valid[t0 + j]);
      const uint16_t *key = keys + (t0 + j) * key_t;
      if (j < n && D == Dp) {
        k[j] = key;
        continue;
      }
      k[j] = padded + j * Dp;
      if (j < n) memcpy(padded + j * Dp, key, D * sizeof(uint16_t));
      else memset(padded + j * Dp, 0, Dp * sizeof(uint16_t));
    }
    if (!live) continue;
    if (D == Dp) { /* (past the end: a hint only) */
      const char *ahead = (const char *)(keys + (t0 + PREFETCH_KEYS) * key_t);
      for (int64_t j = 0; j < WIDE_KEYS; j++)
        for (int64_t a = 0; a < D * 2; a += 64) __builtin_prefetch(ahead + j * key_t * 2 + a);
    }
    raise_block(scores, pair_best_of(qs, M, Dp, k, dots ? dots + t0 : NULL, dot_stride), FOLDED, t0, n, valid, page);
  }
}

/* Keys t0 .. t0 + n - 1 (n <= BLOCK_KEYS) laid out by channel as fp32, block[d][j] = key j's channel d (absent
   keys: zeros), for block_scores. */
static inline void key_block(const void *keys, int64_t key_t, int64_t bytes, int64_t D, int64_t t0, int64_t n,
                             float *block) {
  for (int64_t j = 0; j < BLOCK_KEYS; j++) {
    const void *key = j < n ? (const char *)keys + (t0 + j) * key_t * bytes : NULL;
    for (int64_t d = 0; d < D; d++) block[d * BLOCK_KEYS + j] = key ? widened(key, d, bytes) : 0.0f;
  }
}

/* Every key below `filled` as key_block lays a block out, block after block (blocks [filled / 16 rounded up][D][16]):
   a chunk's blocks of queries then read them instead of laying each block out again (chunk_weights). */
static void key_blocks(const void *keys, int64_t key_t, int64_t bytes, int64_t D, int64_t filled, float *blocks) {
  for (int64_t t0 = 0; t0 < filled; t0 += BLOCK_KEYS)
    key_block(keys, key_t, bytes, D, t0, filled - t0 < BLOCK_KEYS ? filled - t0 : BLOCK_KEYS, blocks + t0 * D);
}

/* The block of n keys from slot t0 (laid out by key_block) against many queries (qw [M][Dw]): every query passes
   over the block with its channels broadcast, each lane one key's dot, no sum across lanes; their best raise the
   block's pages (8 keys at a time). dots: as any_raise_scores keeps them. Never inlined: inlined into
   chunk_weights, GCC 12 kept its 12 sums worse and the call took 1.75x as long. */
static __attribute__((noinline)) void block_scores(const float *qw, int64_t M, int64_t D, int64_t Dw, const float *block, int64_t t0,
                         int64_t n, const uint8_t *valid, int64_t page, float *scores, float *dots, int64_t dot_stride) {
  lanes8 best_low = NONE8, best_high = NONE8;
  for (int64_t m0 = 0; m0 < M; m0 += MANY_GROUP) {
    const int64_t rows = M - m0 < MANY_GROUP ? M - m0 : MANY_GROUP;
    const float *q = qw + m0 * Dw;
    lanes8 low[MANY_GROUP], high[MANY_GROUP]; /* (keys 0-7 and 8-15 of the block) */
    for (int i = 0; i < MANY_GROUP; i++) {
      const float channel = q[(i < rows ? i : 0) * Dw];
      low[i] = channel * load8(block);
      high[i] = channel * load8(block + WIDE);
    }
    for (int64_t d = 1; d < D; d++) {
      const lanes8 first = load8(block + d * BLOCK_KEYS), second = load8(block + d * BLOCK_KEYS + WIDE);
      for (int i = 0; i < MANY_GROUP; i++) {
        const float channel = q[(i < rows ? i : 0) * Dw + d];
        low[i] += channel * first;
        high[i] += channel * second;
      }
    }
    for (int i = 0; i < rows; i++) {
      best_low = larger8(best_low, low[i]);
      best_high = larger8(best_high, high[i]);
      if (dots) {
        memcpy(dots + (m0 + i) * dot_stride + t0, &low[i], sizeof low[i]);
        memcpy(dots + (m0 + i) * dot_stride + t0 + WIDE, &high[i], sizeof high[i]);
      }
    }
  }
  raise_block(scores, best_low, IN_ORDER, t0, n < WIDE ? n : WIDE, valid, page);
  if (n > WIDE) raise_block(scores, best_high, IN_ORDER, t0 + WIDE, n - WIDE, valid, page);
}

/* Many queries (qw [M][Dw]): keys BLOCK_KEYS at a time laid out by channel, each block scored by block_scores
   (blocks: every key laid out before, key_blocks'; NULL: each block laid out here as it comes). dots: as
   any_raise_scores keeps them. */
static void any_many_scores(const float *qw, int64_t M, int64_t D, int64_t Dw, const void *keys, int64_t key_t,
                            int64_t bytes, const uint8_t *valid, int64_t filled, int64_t page, float *scores,
                            float *dots, int64_t dot_stride, const float *blocks) {
  float block[D * BLOCK_KEYS];
  for (int64_t t0 = 0; t0 < filled; t0 += BLOCK_KEYS) {
    const int64_t n = filled - t0 < BLOCK_KEYS ? filled - t0 : BLOCK_KEYS;
    int live = 0;
    for (int64_t j = 0; j < n; j++) live |= !valid || valid[t0 + j];
    if (!live) continue;
    if (!blocks) key_block(keys, key_t, bytes, D, t0, n, block);
    block_scores(qw, M, D, Dw, blocks ? blocks + t0 * D : block, t0, n, valid, page, scores, dots, dot_stride);
  }
}

/* raise_page_scores for any float queries and keys (bytes 2 or 4): scores[n] raised to the best q.k of page n's
   valid slots below `filled`. dots (NULL: not kept): every q.k too, query m's of slot t at dots[m * dot_stride + t]
   (a last block's written whole: the rows are padded). qw: room for the widened queries (scratch_floats); blocks
   (NULL: none): the keys laid out by key_blocks, for many queries. */
static void any_raise_scores(const void *q, int64_t bytes, int64_t M, int64_t D, const void *keys, int64_t key_t,
                             const uint8_t *valid, int64_t filled, int64_t page, float *scores, float *dots,
                             int64_t dot_stride, float *qw, const float *blocks) {
  if (bytes == 2 && M <= WIDE_KEYS) {
    const int64_t Dp = (D + PAIR_CHUNK - 1) / PAIR_CHUNK * PAIR_CHUNK;
    split_queries(q, M, D, Dp, qw);
    pair_few_scores(qw, M, D, Dp, keys, key_t, valid, filled, page, scores, dots, dot_stride);
    return;
  }
  const int64_t Dw = (D + WIDE - 1) / WIDE * WIDE;
  for (int64_t m = 0; m < M; m++) widen_row((const char *)q + m * D * bytes, D, Dw, bytes, qw + m * Dw);
  if (M <= WIDE_KEYS) any_few_scores(qw, M, D, Dw, keys, key_t, valid, filled, page, scores, dots, dot_stride);
  else any_many_scores(qw, M, D, Dw, keys, key_t, bytes, valid, filled, page, scores, dots, dot_stride, blocks);
}

/* Whether keys and queries of `bytes` go by the BF16_DOTS build's bf16 route (VDPBF16PS: it widens nothing and lays
   out its own blocks of keys), not by any_raise_scores. */
static inline int bf16_route(int64_t bytes) {
#ifdef BF16_DOTS
  return bytes == 2;
#else
  (void)bytes;
  return 0;
#endif
}

/* The floats of scratch scores_of needs for M queries of D (0: none, where the bf16 route takes them). */
static int64_t scratch_floats(int64_t bytes, int64_t M, int64_t D) {
  return bf16_route(bytes) ? 0 : M * ((D + PAIR_CHUNK - 1) / PAIR_CHUNK * PAIR_CHUNK);
}

/* Room for scratch_floats(bytes, M, D) in *scratch (NULL where none is needed); 0 where memory ran out. */
static int scratch_for(int64_t bytes, int64_t M, int64_t D, float **scratch) {
  const int64_t floats = scratch_floats(bytes, M, D);
  *scratch = floats ? malloc(floats * sizeof(float)) : NULL;
  return !floats || *scratch;
}

/* Raises a (sequence, head)'s page scores by whichever route takes these queries and keys (bf16 by VDPBF16PS in
   the BF16_DOTS build, else any_raise_scores); dots (the rest's q.k, NULL: not kept) as both keep them; scratch:
   scratch_for's. */
static void raise_scores_of(const void *q, int64_t bytes, int64_t M, int64_t D, const void *keys, int64_t key_t,
                            const uint8_t *valid, int64_t filled, int64_t page, float *scores, float *dots,
                            int64_t dot_stride, float *scratch, const float *blocks) {
#ifdef BF16_DOTS
  if (bytes == 2) {
    raise_page_scores(q, M, D, keys, key_t, valid, filled, page, scores, dots, dot_stride);
    return;
  }
#endif
  any_raise_scores(q, bytes, M, D, keys, key_t, valid, filled, page, scores, dots, dot_stride, scratch, blocks);
}

/* The floats key_blocks lays `filled` keys of D out in where the route for these queries reads them (the portable
   one, any_raise_scores'), else 0 (the bf16 route of the BF16_DOTS build lays out its own). */
static int64_t blocks_floats(int64_t bytes, int64_t filled, int64_t D) {
  return bf16_route(bytes) ? 0 : (filled + BLOCK_KEYS - 1) / BLOCK_KEYS * BLOCK_KEYS * D;
}

/* A (sequence, head)'s page scores: scores[n] for the pages of the slots below `filled`, the best q.k over the
   queries and the page's valid slots (valid NULL: all are), -inf: none; dots and scratch as raise_scores_of's. */
static void scores_of(const void *q, int64_t bytes, int64_t M, int64_t D, const void *keys, int64_t key_t,
                      const uint8_t *valid, int64_t filled, int64_t page, float *scores, float *dots, int64_t dot_stride,
                      float *scratch) {
  for (int64_t n = 0; n * page < filled; n++) scores[n] = -INFINITY;
  raise_scores_of(q, bytes, M, D, keys, key_t, valid, filled, page, scores, dots, dot_stride, scratch, NULL);
}

/* page_best's scores for every (sequence, head); q and keys of `bytes` each (2: bf16, 4: fp32). Returns 0
   where memory ran out (nothing written). */
int64_t h2ochat_page_best(const void *q, int64_t B, int64_t H, int64_t M, int64_t D, const void *keys, int64_t key_b,
                          int64_t key_h, int64_t key_t, const uint8_t *valid, int64_t T, int64_t page, float *out,
                          int64_t bytes) {
  float *scratch;
  if (!scratch_for(bytes, M, D, &scratch)) return 0;
  for (int64_t row = 0; row < B * H; row++)
    scores_of((const char *)q + row * M * D * bytes, bytes, M, D,
              (const char *)keys + (row / H * key_b + row % H * key_h) * bytes, key_t, valid + row * T, T, page,
              out + row * (T / page), NULL, 0, scratch);
  free(scratch);
  return 1;
}

#define SCORED_PAGES 256 /* pages top_pages_row scores at a time (on the stack) */

/* Page n, scored `score`, among the best k so far (top and top_score: *found of them, best first; equal scores in
   page order; -inf: no page). */
static inline void keep_best(float score, int64_t n, int64_t k, int64_t *found, int64_t *top, float *top_score) {
  if (score == -INFINITY) return;
  int64_t at = *found < k ? (*found)++ : k;
  while (at > 0 && score > top_score[at - 1]) {
    if (at < k) top[at] = top[at - 1], top_score[at] = top_score[at - 1];
    at--;
  }
  if (at < k) top[at] = n, top_score[at] = score;
}

/* The best k pages of one (sequence, head) of an append-only store that never wraps (slot n holds the
   n-th token; slots at or past `held` are empty), scoring its first T slots: their page numbers, best
   first, -1 past the pages that hold a token (torch.topk of page_best's scores with -inf masked to -1;
   equal scores in page order). dots: as scores_of keeps them (NULL: not kept); scratch: scratch_for's. */
static void top_pages_row(const void *q, int64_t bytes, int64_t M, int64_t D, const void *keys, int64_t key_t,
                          int64_t held, int64_t T, int64_t page, int64_t k, int64_t *top, float *dots,
                          int64_t dot_stride, float *scratch) {
  float top_score[k > 0 ? k : 1], scores[SCORED_PAGES];
  int64_t found = 0;
  const int64_t filled = held < T ? held : T;
  for (int64_t n = 0; n * page < filled; n++) {
    if (n % SCORED_PAGES == 0) {
      const int64_t first = n * page, left = filled - first;
      scores_of(q, bytes, M, D, (const char *)keys + first * key_t * bytes, key_t, NULL,
                left < SCORED_PAGES * page ? left : SCORED_PAGES * page, page, scores, dots ? dots + first : NULL,
                dot_stride, scratch);
    }
    keep_best(scores[n % SCORED_PAGES], n, k, &found, top, top_score);
  }
  for (int64_t j = found; j < k; j++) top[j] = -1;
}

/* top_pages_row's pages from scores already computed (scores[n] for the row's `pages` pages; a chunk's). */
static void top_of_scores(const float *scores, int64_t pages, int64_t k, int64_t *top) {
  float top_score[k > 0 ? k : 1];
  int64_t found = 0;
  for (int64_t n = 0; n < pages; n++) keep_best(scores[n], n, k, &found, top, top_score);
  for (int64_t j = found; j < k; j++) top[j] = -1;
}

/* top_pages_row for every (sequence, head): count [B, H], wanted [B, H, k]; q and keys of `bytes` each.
   Returns 0 where memory ran out (nothing written). */
int64_t h2ochat_top_pages(const void *q, int64_t B, int64_t H, int64_t M, int64_t D, const void *keys, int64_t key_b,
                          int64_t key_h, int64_t key_t, const int64_t *count, int64_t T, int64_t page, int64_t k,
                          int64_t *wanted, int64_t bytes) {
  float *scratch;
  if (!scratch_for(bytes, M, D, &scratch)) return 0;
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      top_pages_row((const char *)q + (b * H + h) * M * D * bytes, bytes, M, D,
                    (const char *)keys + (b * key_b + h * key_h) * bytes, key_t, count[b * H + h], T, page, k,
                    wanted + (b * H + h) * k, NULL, 0, scratch);
  free(scratch);
  return 1;
}

/* RecallFrames.update for frames in host memory (contiguous int64 / bool rows, one per (sequence, head)):
   the same plan, op for op (step.py has the torch version and its reasons). wanted [R, k]; frame_page,
   last_used, complete [R, F]; clock, copied [R]; complete_pages [R] or NULL; load [R, F] out. */
static void frames_update_row(int64_t F, int64_t k, const int64_t *want, int64_t *page, int64_t *used,
                              int64_t *clock, int64_t *copied, uint8_t *done, const int64_t *complete_pages,
                              uint8_t *loads) {
  const int64_t now = ++*clock;
  uint8_t kept[F > 0 ? F : 1];
  int64_t order[F > 0 ? F : 1], target[k > 0 ? k : 1];
  for (int64_t f = 0; f < F; f++) {
    kept[f] = 0;
    for (int64_t j = 0; j < k; j++) kept[f] |= want[j] >= 0 && page[f] == want[j];
    loads[f] = 0;
  }
  /* free frames, least recently used first (stable: equal clocks in frame order), kept frames last */
  for (int64_t f = 0; f < F; f++) {
    int64_t at = f;
    while (at > 0) {
      const int64_t other = order[at - 1];
      const int big_f = kept[f], big_o = kept[other];
      if (big_o < big_f || (big_o == big_f && (big_f || used[other] <= used[f]))) break;
      order[at] = other;
      at--;
    }
    order[at] = f;
  }
  /* the j-th missing page (in wanted order) to the j-th free frame */
  int64_t missing = 0;
  for (int64_t j = 0; j < k; j++) {
    target[j] = -1;
    if (want[j] < 0) continue;
    int found = 0;
    for (int64_t f = 0; f < F; f++) found |= page[f] == want[j];
    if (!found && missing < F) target[j] = order[missing++];
  }
  for (int64_t j = 0; j < k; j++)
    if (target[j] >= 0) loads[target[j]] = 1;
  int64_t new_page[F > 0 ? F : 1];
  for (int64_t j = 0; j < k; j++)
    if (target[j] >= 0) new_page[target[j]] = want[j];
  for (int64_t f = 0; f < F; f++) {
    if (loads[f]) page[f] = new_page[f];
    if (kept[f] || loads[f]) used[f] = now;
    *copied += loads[f];
  }
  if (complete_pages)
    for (int64_t f = 0; f < F; f++) {
      loads[f] |= !done[f] && page[f] >= 0;
      if (loads[f]) done[f] = page[f] < *complete_pages;
    }
}

void h2ochat_frames_update(int64_t rows, int64_t F, int64_t k, const int64_t *wanted, int64_t *frame_page,
                           int64_t *last_used, int64_t *clock, int64_t *copied, uint8_t *complete,
                           const int64_t *complete_pages, uint8_t *load) {
  for (int64_t r = 0; r < rows; r++)
    frames_update_row(F, k, wanted + r * k, frame_page + r * F, last_used + r * F, clock + r, copied + r,
                      complete + r * F, complete_pages ? complete_pages + r : NULL, load + r * F);
}

/* Where a store's buffer and a layer's slot columns are: base pointer and strides (elements) of the
   (sequence, head, slot) dims. */
typedef struct {
  void *data;
  int64_t b, h, s;
} strided_t;

static inline void *at(const strided_t *t, int64_t b, int64_t h, int64_t s, int64_t item) {
  return (char *)t->data + (b * t->b + h * t->h + s * t->s) * item;
}

#ifdef BF16_DOTS
/* The lanes of the n - d values left from d (all 16 past the last chunk). */
static inline __mmask16 lanes(int64_t n, int64_t d) {
  return n - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - d)) - 1u);
}

/* 16 values (fewer: mask) from bf16 (bytes 2) or fp32 (4), as fp32; lanes past the mask read 0. */
static inline __m512 load_floats(const void *p, int64_t bytes, __mmask16 mask) {
  if (bytes == 4) return _mm512_maskz_loadu_ps(mask, p);
  const __m256i halves = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16((__mmask32)mask, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

/* out[d] = codes[d] * scale for d < n, as bf16 (bytes 2: VCVTNEPS2BF16 rounds to nearest even as torch does;
   a product of a code and a scale of max |x| / 127 is never subnormal) or fp32 (4). */
static inline void store_scaled(const int8_t *codes, float scale, int64_t n, void *out, int64_t bytes) {
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 mask = lanes(n, d);
    const __m128i bytes16 = _mm512_castsi512_si128(_mm512_maskz_loadu_epi8((__mmask64)mask, codes + d));
    const __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16)), _mm512_set1_ps(scale));
    if (bytes == 4) _mm512_mask_storeu_ps((float *)out + d, mask, x);
    else _mm512_mask_storeu_epi16((uint16_t *)out + d, (__mmask32)mask, _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(x)));
  }
}

/* n values (bf16 or fp32, value_bytes) as int8 codes with one fp32 scale, max |x| / 127: cold_store._to_int8's
   codes, bit for bit (fp32 division, rounded to nearest even, clamped to +-127). Returns the scale. */
static inline float quantize(const void *values, int64_t n, int64_t value_bytes, int8_t *codes) {
  __m512 largest = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 16)
    largest = _mm512_max_ps(largest, _mm512_abs_ps(load_floats((const char *)values + d * value_bytes, value_bytes,
                                                               lanes(n, d))));
  const float top = _mm512_reduce_max_ps(largest), scale = (top > 1e-30f ? top : 1e-30f) / 127.0f;
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 mask = lanes(n, d);
    const __m512 x = load_floats((const char *)values + d * value_bytes, value_bytes, mask);
    __m512 code = _mm512_roundscale_ps(_mm512_div_ps(x, _mm512_set1_ps(scale)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    code = _mm512_min_ps(_mm512_max_ps(code, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    _mm512_mask_storeu_epi8(codes + d, (__mmask64)mask, _mm512_castsi128_si512(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(code))));
  }
  return scale;
}

/* n values (bf16: bytes 2, fp32: 4) as quantized slots hold them (h2ochat_kernels.quant.level_codes, 8 bits):
   offset = min, scale = max((max - min) / 255, tiny), codes = round((x - min) / scale) to nearest even, as
   uint8; each an IEEE fp32 op, as torch's, so the same codes and scales bit for bit. */
static inline void level_codes(const void *values, int64_t n, int64_t bytes, float tiny, uint8_t *codes,
                               float *scale_out, float *offset_out) {
  __m512 low = _mm512_set1_ps(INFINITY), high = _mm512_set1_ps(-INFINITY);
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 mask = lanes(n, d);
    const __m512 x = load_floats((const char *)values + d * bytes, bytes, mask);
    low = _mm512_mask_min_ps(low, mask, low, x);
    high = _mm512_mask_max_ps(high, mask, high, x);
  }
  const float offset = _mm512_reduce_min_ps(low), top = _mm512_reduce_max_ps(high);
  float scale = (top - offset) / 255.0f;
  if (!(scale >= tiny)) scale = tiny;
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 mask = lanes(n, d);
    const __m512 x = load_floats((const char *)values + d * bytes, bytes, mask);
    const __m512 code = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(x, _mm512_set1_ps(offset)), _mm512_set1_ps(scale)),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm512_mask_storeu_epi8(codes + d, (__mmask64)mask, _mm512_castsi128_si512(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(code))));
  }
  *scale_out = scale;
  *offset_out = offset;
}
#else /* the portable build: the same values, element by element (each an IEEE fp32 op, as the vector ones) */

static inline void store_scaled(const int8_t *codes, float scale, int64_t n, void *out, int64_t bytes) {
  for (int64_t d = 0; d < n; d++) {
    const float x = (float)codes[d] * scale;
    if (bytes == 4) ((float *)out)[d] = x;
    else ((uint16_t *)out)[d] = to_bf16(x);
  }
}

static inline float quantize(const void *values, int64_t n, int64_t value_bytes, int8_t *codes) {
  float top = 0.0f;
  for (int64_t d = 0; d < n; d++) top = larger(top, fabsf(widened(values, d, value_bytes)));
  const float scale = (top > 1e-30f ? top : 1e-30f) / 127.0f;
  for (int64_t d = 0; d < n; d++) {
    float code = rintf(widened(values, d, value_bytes) / scale);
    code = code < -127.0f ? -127.0f : code > 127.0f ? 127.0f : code;
    codes[d] = (int8_t)code;
  }
  return scale;
}

static inline void level_codes(const void *values, int64_t n, int64_t bytes, float tiny, uint8_t *codes,
                               float *scale_out, float *offset_out) {
  float offset = INFINITY, top = -INFINITY;
  for (int64_t d = 0; d < n; d++) {
    const float x = widened(values, d, bytes);
    offset = x < offset ? x : offset;
    top = larger(top, x);
  }
  float scale = (top - offset) / 255.0f;
  if (!(scale >= tiny)) scale = tiny;
  for (int64_t d = 0; d < n; d++) codes[d] = (uint8_t)(int32_t)rintf((widened(values, d, bytes) - offset) / scale);
  *scale_out = scale;
  *offset_out = offset;
}
#endif /* BF16_DOTS */

/* fill_recall_slots for a plan read on the host: each loaded frame f of (b, h) takes page frame_page of the
   cold store, slot by slot (an absent slot: zeros, token index and position -1). Float slots are of
   value_bytes (2: bf16, 4: fp32): keys are copied from the store's key_bytes (bf16 keys widened for fp32
   slots); values too (value_scale NULL) or int8 codes times the token's fp32 scale. Store token indices and
   positions are int32, the slots' int64. ring: the store's frames (0: it never wraps). scales (NULL: float
   slots): the slots are 8-bit codes (D and Dv bytes) with [0] key_scale, [1] key_offset, [2] value_scale,
   [3] value_offset (fp32) beside them; key_bytes is then the store's keys', value_bytes the floats values are
   read or scaled to, and each slot's keys and values as page_tokens gives them (absent: zeros) are encoded by
   level_codes, as slot_format.encode does. */
static void fill_row(int64_t b, int64_t h, int64_t F, int64_t P, const uint8_t *load, const int64_t *frame_page,
                     int64_t held, int64_t ring, const strided_t *store, const strided_t *slots, int64_t D,
                     int64_t key_bytes, int64_t Dv, int64_t value_bytes, const strided_t *scales, float tiny) {
  /* store/slots: [0] keys, [1] values, [2] token index, [3] positions; store [4]: value scales (data NULL: none) */
  const int64_t end = (held + P - 1) / P, first = ring && end > ring ? end - ring : 0;
  const int64_t key_item = scales ? 1 : value_bytes, value_item = scales ? 1 : value_bytes;
  uint8_t scratch[scales ? (D > Dv ? D : Dv) * 4 : 1]; /* (zeros, or a slot's values as the store's dtype) */
  for (int64_t f = 0; f < F; f++) {
    if (!load[f]) continue;
    const int64_t page = frame_page[f];
    for (int64_t i = 0; i < P; i++) {
      const int64_t slot = page * P + i, column = f * P + i;
      const int present = page >= 0 && slot < held && page >= first;
      const int64_t source = ring ? slot % (ring * P) : slot;
      void *key = at(&slots[0], b, h, column, key_item), *value = at(&slots[1], b, h, column, value_item);
      int64_t *token = at(&slots[2], b, h, column, 8), *position = at(&slots[3], b, h, column, 8);
      if (scales) {
        const void *keys = scratch, *values = scratch;
        if (present) {
          keys = at(&store[0], b, h, source, key_bytes);
          values = at(&store[1], b, h, source, store[4].data ? 1 : value_bytes);
          *token = *(const int32_t *)at(&store[2], b, h, source, 4);
          *position = *(const int32_t *)at(&store[3], b, h, source, 4);
        } else {
          memset(scratch, 0, sizeof scratch);
          *token = *position = -1;
        }
        level_codes(keys, D, key_bytes, tiny, key, at(&scales[0], b, h, column, 4), at(&scales[1], b, h, column, 4));
        if (present && store[4].data) {
          store_scaled(values, *(const float *)at(&store[4], b, h, source, 4), Dv, scratch, value_bytes);
          values = scratch;
        }
        level_codes(values, Dv, value_bytes, tiny, value, at(&scales[2], b, h, column, 4),
                    at(&scales[3], b, h, column, 4));
        continue;
      }
      if (!present) {
        memset(key, 0, D * value_bytes);
        memset(value, 0, Dv * value_bytes);
        *token = *position = -1;
        continue;
      }
      copy_floats(key, value_bytes, at(&store[0], b, h, source, key_bytes), key_bytes, D);
      *token = *(const int32_t *)at(&store[2], b, h, source, 4);
      *position = *(const int32_t *)at(&store[3], b, h, source, 4);
      if (!store[4].data) {
        memcpy(value, at(&store[1], b, h, source, value_bytes), Dv * value_bytes);
        continue;
      }
      store_scaled(at(&store[1], b, h, source, 1), *(const float *)at(&store[4], b, h, source, 4), Dv, value,
                   value_bytes);
    }
  }
}

void h2ochat_fill_frames(int64_t B, int64_t H, int64_t F, int64_t P, const uint8_t *load, const int64_t *frame_page,
                         const int64_t *count, int64_t ring, const strided_t *store, const strided_t *slots,
                         int64_t D, int64_t key_bytes, int64_t Dv, int64_t value_bytes, const strided_t *scales,
                         float tiny) {
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = b * H + h;
      fill_row(b, h, F, P, load + row * F, frame_page + row * F, count[row], ring, store, slots, D, key_bytes, Dv,
               value_bytes, scales, tiny);
    }
}

/* ---- The rest of the cold pages (recall/rest.py's rest_column from the q.k the choice computed) ---- */

#ifdef BF16_DOTS
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

#else /* the portable build: the same sums, by vectors of 8 (exp8 for exp_lanes) or element by element */

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
#endif /* BF16_DOTS */

/* The sum of a page's n values (Dv each) into sum[Dv], each value as the cold store hands it out
   (cold_store._tokens: as stored, or int8 codes times the token's fp32 scale rounded to the store's float dtype,
   value_bytes 2: bf16, 4: fp32), in fp32. */
static void page_value_sum(const strided_t *store, int64_t b, int64_t h, int64_t first, int64_t n, int64_t Dv,
                           int64_t value_bytes, float *sum) {
  float scaled[Dv]; /* (an int8 slot's values as fill_row hands them to the slots: store_scaled's) */
  memset(sum, 0, Dv * sizeof(float));
  for (int64_t t = first; t < first + n; t++) {
    const void *values = at(&store[1], b, h, t, store[4].data ? 1 : value_bytes);
    if (store[4].data) {
      store_scaled(values, *(const float *)at(&store[4], b, h, t, 4), Dv, scaled, value_bytes);
      values = scaled;
    }
    for (int64_t d = 0; d < Dv; d++) sum[d] += widened(values, d, value_bytes);
  }
}

/* The mean values of the row's full pages below `filled` it has not yet (means [N, Dv], *meaned of them held;
   more than `filled` has: the row was emptied, all again), as page_value_sum over P. */
static void fill_means(const strided_t *store, int64_t b, int64_t h, int64_t filled, int64_t P, int64_t Dv,
                       int64_t value_bytes, float *means, int64_t N, int64_t *meaned) {
  const int64_t full = filled / P < N ? filled / P : N;
  if (*meaned > full) *meaned = 0;
  for (int64_t n = *meaned; n < full; n++) {
    float *mean = means + n * Dv;
    page_value_sum(store, b, h, n * P, P, Dv, value_bytes, mean);
    for (int64_t d = 0; d < Dv; d++) mean[d] /= (float)P;
  }
  *meaned = full;
}

/* For each of M queries (q.k in dots [M, dot_stride], the slots below `filled`): top[m], its largest q.k (over every
   slot: only keeps the exponents below 0), and its pages' weights w[m * pages ...] (page_sums', no page left out). */
static void rest_weights(float *dots, int64_t dot_stride, int64_t M, int64_t filled, int64_t P, float scale,
                         float *top, float *w) {
  const int64_t pages = (filled + P - 1) / P;
  for (int64_t m = 0; m < M; m++) {
    float *row = dots + m * dot_stride;
    top[m] = row_max(row, filled);
    page_sums(row, top[m], scale, filled, P, w + m * pages);
  }
}

#define REST_QUERY_BLOCK 32 /* a chunk's queries whose q.k are kept at a time (32 x 4K keys: 512 KB, in L2) */

/* A chunk's page scores and rest weights (M > FEW_QUERIES queries, before its choice): scores[n] = the best q.k of
   page n over every query (scores_of'), and rest_weights' top[m] and w[m * pages ...] for each query, taking
   REST_QUERY_BLOCK queries at a time through raise_scores_of (their q.k in dots [REST_QUERY_BLOCK, dot_stride]):
   the q.k of a whole chunk (M x the slots) never sit in memory at once. q and keys of `bytes`; scratch:
   scratch_for's; blocks: room for blocks_floats(bytes, filled, D) floats (NULL where that is 0), the keys laid out
   once for every block of queries (laid out again for each, they took a seventh of a 900-query chunk's call). */
static void chunk_weights(const void *q, int64_t bytes, int64_t M, int64_t D, const void *keys, int64_t key_t,
                          int64_t filled, int64_t P, float scale, float *scores, float *dots, int64_t dot_stride,
                          float *top, float *w, float *scratch, float *blocks) {
  const int64_t pages = (filled + P - 1) / P;
  for (int64_t n = 0; n < pages; n++) scores[n] = -INFINITY;
  if (blocks) key_blocks(keys, key_t, bytes, D, filled, blocks);
  for (int64_t m0 = 0; m0 < M; m0 += REST_QUERY_BLOCK) {
    const int64_t rows = M - m0 < REST_QUERY_BLOCK ? M - m0 : REST_QUERY_BLOCK;
    raise_scores_of((const char *)q + m0 * D * bytes, bytes, rows, D, keys, key_t, NULL, filled, P, scores, dots,
                    dot_stride, scratch, blocks);
    rest_weights(dots, dot_stride, rows, filled, P, scale, top + m0, w + m0 * pages);
  }
}

/* The rest of one (sequence b, head h) (recall/rest.py's rest_column, the same sums up to their order): the
   store's slots below `filled` on pages the frames do not hold (frame_page [F]), one attention column per
   query m: logit[m] = the logsumexp of their logits scale * q_m.k (-inf: no such slot), value[m * Dv ...] = the
   pages' mean values (means [N, Dv], fill_means'; a part page's from its values) weighed by each page's share
   of that sum (the means have room for the full pages: filled / P <= N). The pages' weights [M, pages] and each
   query's top: rest_weights' from dots [M, dot_stride] (the q.k, overwritten by their exps), computed here when
   a page is left; or (dots NULL) given, a chunk's (chunk_weights). recalled: a byte a page of scratch. */
static void rest_row(int64_t b, int64_t h, float *dots, int64_t dot_stride, int64_t M, int64_t filled, int64_t P,
                     const int64_t *frame_page, int64_t F, const strided_t *store, int64_t Dv, int64_t value_bytes, float scale,
                     float *top, float *weights, uint8_t *recalled, float *means, int64_t N, int64_t *meaned,
                     float *logit, float *value) {
  const int64_t pages = (filled + P - 1) / P;
  fill_means(store, b, h, filled, P, Dv, value_bytes, means, N, meaned);
  memset(recalled, 0, pages);
  int64_t left = pages;
  for (int64_t f = 0; f < F; f++)
    if (frame_page[f] >= 0 && frame_page[f] < pages && !recalled[frame_page[f]]) recalled[frame_page[f]] = 1, left--;
  float total[M], part[Dv];
  if (left && *meaned < pages && !recalled[pages - 1]) { /* (the last page is a part page: its mean now) */
    const int64_t first = *meaned * P;
    page_value_sum(store, b, h, first, filled - first, Dv, value_bytes, part);
    for (int64_t d = 0; d < Dv; d++) part[d] /= (float)(filled - first);
  }
  if (left && dots) rest_weights(dots, dot_stride, M, filled, P, scale, top, weights);
  for (int64_t m = 0; m < M; m++) total[m] = left ? unrecalled_sum(weights + m * pages, pages, recalled) : 0.0f;
  if (left) weigh_means(weights, M, pages, recalled, means, *meaned, part, Dv, value);
  for (int64_t m = 0; m < M; m++) {
    logit[m] = -INFINITY;
    if (!(total[m] > 0.0f)) { /* (no page left, or every one below e^-87 of the best slot: nothing drawn) */
      memset(value + m * Dv, 0, Dv * sizeof(float));
      continue;
    }
    logit[m] = top[m] * scale + logf(total[m]);
    scale_floats(value + m * Dv, Dv, 1.0f / total[m]);
  }
}

/* A step's whole choice (a decode step's, or a prompt chunk's with the rest) for the exact selector over a store
   that never wraps, every row choosing:
   top_pages_row (k = min(F, T / P) pages, wanted [B, H, k] out), frames_update_row with the store's
   full pages complete, fill_row (load [B, H, F] out) for each (sequence, head), in one call; a row and
   head with nothing in the store only counts the choice on its clock (its frames are empty: what the
   update would do). The frames' state is [B, H, F] (clock, copied [B, H]); keys are the store's (store[0]),
   keys of `bytes` each (2: bf16, 4: fp32), q of query_bytes (the same, or fp32 queries for bf16 keys: rounded
   here to bf16 as torch rounds them, so both routes score the same products).
   choosing [B] (bytes; NULL: every row): a row not choosing is left as it is (its frames, clock and slots
   untouched, its load and wanted not written), as the torch route's rows_kept leaves it. scales, tiny:
   quantized slots (fill_row); value_bytes: the slots' float dtype's (float slots: bf16 keys are widened
   into fp32 ones) or the model's, that quantized slots' values are scaled to before their codes.
   rest_logit [B, H, M], rest_value [B, H, M, Dv] (NULL: no rest): after the choice, every row's rest (rest_row), choosing or not, from the q.k the choice computed (a row not choosing:
   computed for it; more than FEW_QUERIES queries, a chunk's: the pages' weights of each block of queries as its
   q.k come, chunk_weights), with the page means means [B, H, N, Dv] of which meaned [B, H] are held (rest_row
   fills them). Returns the rows and heads that hold a cold token (0: the rest is -inf everywhere), or -1 where
   memory ran out or the means have no room for T / P pages (nothing written). */
int64_t h2ochat_recall_step(const void *q, int64_t B, int64_t H, int64_t M, int64_t D, const int64_t *count,
                            int64_t T, int64_t P, int64_t F, int64_t *wanted, int64_t *frame_page, int64_t *last_used,
                            int64_t *clock, int64_t *copied, uint8_t *complete, uint8_t *load, const strided_t *store,
                            const strided_t *slots, int64_t Dv, int64_t value_bytes, const uint8_t *choosing,
                            const strided_t *scales, float tiny, float scale, float *rest_logit, float *rest_value,
                            float *means, int64_t N, int64_t *meaned, int64_t bytes, int64_t query_bytes) {
  const int64_t k = F < T / P ? F : T / P, stride = (T + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK + KEY_BLOCK;
  uint16_t *rounded = NULL; /* (fp32 queries against bf16 keys: rounded here, as scored_queries rounds them) */
  if (query_bytes != bytes) {
    if (query_bytes != 4 || bytes != 2 || !(rounded = malloc(B * H * M * D * sizeof(uint16_t)))) return -1;
    copy_floats(rounded, 2, q, 4, B * H * M * D);
    q = rounded;
  }
  const int64_t pages = (T + P - 1) / P;
  /* a chunk's rest (more queries than a decode step's): its weights by blocks of queries, before its choice */
  const int chunk = rest_logit && M > FEW_QUERIES;
  const int64_t kept = chunk && M > REST_QUERY_BLOCK ? REST_QUERY_BLOCK : M;
  float *dots = NULL, *scores = NULL, *weights = NULL, *top = NULL, *scratch;
  uint8_t *recalled = NULL;
  if (rest_logit) { /* (q.k [kept, stride], the page scores, the pages' weights, each query's top, a byte a page) */
    dots = T / P > N ? NULL : malloc((kept * stride + pages + M * pages + M) * sizeof(float) + pages);
    if (!dots) {
      free(rounded);
      return -1;
    }
    scores = dots + kept * stride;
    weights = scores + pages;
    top = weights + M * pages;
    recalled = (uint8_t *)(top + M);
  }
  const int64_t laid = chunk ? blocks_floats(bytes, T, D) : 0; /* (the chunk's keys laid out once: key_blocks) */
  float *blocks = laid ? malloc(laid * sizeof(float)) : NULL;
  if (!scratch_for(bytes, M, D, &scratch) || (laid && !blocks)) {
    free(scratch);
    free(blocks);
    free(dots);
    free(rounded);
    return -1;
  }
  int64_t holding = 0;
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = b * H + h, complete_pages = count[row] / P, filled = count[row] < T ? count[row] : T;
      const void *keys = at(&store[0], b, h, 0, bytes), *queries = (const char *)q + row * M * D * bytes;
      holding += count[row] > 0;
      if (!choosing || choosing[b]) {
        if (!count[row]) { /* nothing flushed yet: the clock counts the choice (RecallFrames.tick) */
          clock[row]++;
          memset(load + row * F, 0, F);
        } else {
          if (chunk) {
            chunk_weights(queries, bytes, M, D, keys, store[0].s, filled, P, scale, scores, dots, stride, top, weights,
                          scratch, blocks);
            top_of_scores(scores, (filled + P - 1) / P, k, wanted + row * k);
          } else {
            top_pages_row(queries, bytes, M, D, keys, store[0].s, count[row], T, P, k, wanted + row * k, dots, stride,
                          scratch);
          }
          frames_update_row(F, k, wanted + row * k, frame_page + row * F, last_used + row * F, clock + row,
                            copied + row, complete + row * F, &complete_pages, load + row * F);
          fill_row(b, h, F, P, load + row * F, frame_page + row * F, count[row], 0, store, slots, D, bytes, Dv,
                   value_bytes, scales, tiny);
        }
      }
      else if (chunk && filled) {
        chunk_weights(queries, bytes, M, D, keys, store[0].s, filled, P, scale, scores, dots, stride, top, weights,
                      scratch, blocks);
      } else if (rest_logit && filled) {
        scores_of(queries, bytes, M, D, keys, store[0].s, NULL, filled, P, scores, dots, stride, scratch);
      }
      if (rest_logit)
        rest_row(b, h, chunk ? NULL : dots, stride, M, filled, P, frame_page + row * F, F, store, Dv, value_bytes, scale,
                 top, weights, recalled, means + row * N * Dv, N, meaned + row, rest_logit + row * M,
                 rest_value + row * M * Dv);
    }
  free(scratch);
  free(blocks);
  free(dots);
  free(rounded);
  return holding;
}

/* StagingPage.put: the victim in policy column slot[b, h] of each (sequence, head) copied into staging
   column count[b, h] (< P), then counted. sources/targets: [0] keys (D elements of key_bytes), [1] values
   (Dv of value_bytes), [2] token index, [3] positions (int64): the layer's policy columns and its staging
   columns; [4 ...] (extras of them): 4-byte values a slot (a quantized slot's scales and offsets). active
   [B] (bytes; NULL: every row): a row left out writes an empty entry (its victim with token index -1) and
   does not count it, as the torch route's put does. */
void h2ochat_stage(int64_t B, int64_t H, int64_t P, const int64_t *slot, int64_t *count, const strided_t *sources,
                   const strided_t *targets, int64_t D, int64_t key_bytes, int64_t Dv, int64_t value_bytes,
                   const uint8_t *active, int64_t extras) {
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = b * H + h, from = slot[row], to = count[row];
      const int in_step = !active || active[b];
      if (to >= P) continue; /* (never: the page is flushed before a step that could fill it past P) */
      memcpy(at(&targets[0], b, h, to, key_bytes), at(&sources[0], b, h, from, key_bytes), D * key_bytes);
      memcpy(at(&targets[1], b, h, to, value_bytes), at(&sources[1], b, h, from, value_bytes), Dv * value_bytes);
      *(int64_t *)at(&targets[2], b, h, to, 8) = in_step ? *(const int64_t *)at(&sources[2], b, h, from, 8) : -1;
      *(int64_t *)at(&targets[3], b, h, to, 8) = *(const int64_t *)at(&sources[3], b, h, from, 8);
      for (int64_t e = 4; e < 4 + extras; e++)
        *(uint32_t *)at(&targets[e], b, h, to, 4) = *(const uint32_t *)at(&sources[e], b, h, from, 4);
      count[row] = to + in_step;
    }
}

/* One entry e of (sequence b, head h) of ``in`` into store slot ``slot`` (see h2ochat_cold_append). */
static inline void store_entry(const strided_t *in, int64_t b, int64_t h, int64_t e, int64_t token,
                               const strided_t *store, int64_t slot, int64_t D, int64_t key_bytes,
                               int64_t store_key_bytes, int64_t Dv, int64_t value_bytes) {
  const int64_t position = *(const int64_t *)at(&in[3], b, h, e, 8);
  *(int32_t *)at(&store[2], b, h, slot, 4) = (int32_t)token;
  *(int32_t *)at(&store[3], b, h, slot, 4) = (int32_t)position;
  *(int32_t *)at(&store[4], b, h, slot, 4) = (int32_t)position;
  copy_floats(at(&store[0], b, h, slot, store_key_bytes), store_key_bytes, at(&in[0], b, h, e, key_bytes), key_bytes, D);
  const void *values = at(&in[1], b, h, e, value_bytes);
  if (!store[5].data) {
    memcpy(at(&store[1], b, h, slot, value_bytes), values, Dv * value_bytes);
    return;
  }
  *(float *)at(&store[5], b, h, slot, 4) = quantize(values, Dv, value_bytes, at(&store[1], b, h, slot, 1));
}

/* ColdStore.append for a store that never wraps, room reserved: each (sequence, head)'s entries e < E whose
   token index is >= 0 go to slots count, count + 1, ... in order (slots[b, h, e] out: the slot, or -1).
   in/store: [0] keys, [1] values, [2] token index (int64 in, int32 stored), [3] positions (likewise;
   stored as positions and as encoded, store[4]); store[5] value scales (data NULL: values copied as
   they are, value_bytes each; else int8 codes of bf16 (value_bytes 2) or fp32 (4) values with one fp32
   scale, max |x| / 127, as cold_store._to_int8 makes them). Keys are copied (D elements of key_bytes), into
   the store's store_key_bytes (fp32 keys rounded to bf16 for a store of bf16 keys). */
void h2ochat_cold_append(int64_t B, int64_t H, int64_t E, int64_t *count, int64_t capacity, const strided_t *in,
                         const strided_t *store, int64_t D, int64_t key_bytes, int64_t Dv, int64_t value_bytes,
                         int64_t store_key_bytes, int64_t *slots) {
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = b * H + h;
      for (int64_t e = 0; e < E; e++) {
        const int64_t token = *(const int64_t *)at(&in[2], b, h, e, 8);
        if (token < 0) {
          slots[row * E + e] = -1;
          continue;
        }
        const int64_t slot = count[row]++;
        slots[row * E + e] = slot;
        if (slot < capacity) /* (always: the caller reserved room) */
          store_entry(in, b, h, e, token, store, slot, D, key_bytes, store_key_bytes, Dv, value_bytes);
      }
    }
}

/* RecallTier.flush of the sequences marked in ``rows`` ([B] bytes; NULL: every one): each one's staging
   entries (``page``: the staging columns, laid out as h2ochat_cold_append's ``in``) appended to the store
   as h2ochat_cold_append appends them, then its staging columns emptied (token index and position -1) and
   its entry count staged[b, h] zeroed, as StagingPage.clear does. The other sequences are left as they are. */
void h2ochat_flush(int64_t B, int64_t H, int64_t E, const uint8_t *rows, int64_t *count, int64_t capacity,
                   const strided_t *page, const strided_t *store, int64_t D, int64_t key_bytes, int64_t Dv,
                   int64_t value_bytes, int64_t store_key_bytes, int64_t *staged) {
  for (int64_t b = 0; b < B; b++) {
    if (rows && !rows[b]) continue;
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = b * H + h;
      for (int64_t e = 0; e < E; e++) {
        int64_t *token_index = (int64_t *)at(&page[2], b, h, e, 8);
        const int64_t token = *token_index;
        if (token >= 0) {
          const int64_t slot = count[row]++;
          if (slot < capacity) /* (always: the caller reserved room) */
            store_entry(page, b, h, e, token, store, slot, D, key_bytes, store_key_bytes, Dv, value_bytes);
        }
        *token_index = -1;
        *(int64_t *)at(&page[3], b, h, e, 8) = -1;
      }
      staged[row] = 0;
    }
  }
}
