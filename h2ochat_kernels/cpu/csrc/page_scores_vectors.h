/* Page scores over any float keys by vectors of 8 fp32 lanes (GCC vector extensions: one AVX2 register
   where the variant is built with -mavx2, two SSE registers in the generic one). Every variant has it: fp32
   keys everywhere, bf16 keys where there is no VDPBF16PS. A few queries go 8 keys at a time, their sums
   folded (bf16 keys split into two fp32 vectors as they are read); more by blocks of keys laid out by channel. */

#pragma once

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
