/* A step's whole recall choice for one layer in one call: page scores, the frames' plan, the fill, the rest. */

#pragma once

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

