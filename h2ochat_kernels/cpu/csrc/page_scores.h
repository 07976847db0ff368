/* The exported page-score entries (h2ochat_page_best, h2ochat_top_pages): each (sequence, head)'s pages
   scored by the route its dtype takes in this variant (HAS_BF16_DOTS: bf16 by VDPBF16PS; else by vectors).

   out[b, h, n] = max over valid slots t of page n, over queries m, of sum_d q[b, h, m, d] * k[b, h, t, d]
   (-inf where the page has no valid slot), summed in fp32: the torch reference's
   (h2ochat_kernels.recall_reference.page_scores) up to the order of the sums. */

#pragma once

/* 1 where this variant has the bf16 dot products by VDPBF16PS, 0 where not. */
int64_t h2ochat_bf16_dots(void) { return HAS_BF16_DOTS; }


/* Whether keys and queries of `bytes` go by this variant's bf16 route (VDPBF16PS: it widens nothing and lays out
   its own blocks of keys), not by any_raise_scores. */
static inline int bf16_route(int64_t bytes) { return HAS_BF16_DOTS && bytes == 2; }

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
   the avx512bf16 variant, else any_raise_scores); dots (the rest's q.k, NULL: not kept) as both keep them; scratch:
   scratch_for's. */
static void raise_scores_of(const void *q, int64_t bytes, int64_t M, int64_t D, const void *keys, int64_t key_t,
                            const uint8_t *valid, int64_t filled, int64_t page, float *scores, float *dots,
                            int64_t dot_stride, float *scratch, const float *blocks) {
  if (bf16_route(bytes)) {
    raise_page_scores(q, M, D, keys, key_t, valid, filled, page, scores, dots, dot_stride);
    return;
  }
  any_raise_scores(q, bytes, M, D, keys, key_t, valid, filled, page, scores, dots, dot_stride, scratch, blocks);
}

/* The floats key_blocks lays `filled` keys of D out in where the route for these queries reads them (the portable
   one, any_raise_scores'), else 0 (the bf16 route of the avx512bf16 variant lays out its own). */
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

