/* The rest column (h2ochat/recall/rest.py's rest_column, the same sums up to their order): each unrecalled
   cold page weighed by the logsumexp of its tokens' logits, holding their mean value. */

#pragma once


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

