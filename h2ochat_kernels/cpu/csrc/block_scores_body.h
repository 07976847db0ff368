/* The block score pass, one (request, KV head) row at a time: what every variant of the block_scores module shares.
   The unit that includes this includes its vector kind first (vectors_avx512.h or vectors_portable.h, with
   vector_math.h's vexp and element) and defines `key_tile` after it, the dots of up to four queries with LANES
   consecutive tokens of one block.

   A row's logits (its Q queries' G heads against every token of its kept blocks; query i of Q sits at place
   S - Q + i and sees the places up to it) are kept in the workspace, so the keys are read once; each query head's
   softmax then takes two passes over its logits (the largest, then the
   exponentials summed per block and in all), and each block gets its exponentials' share of the head's total. The
   per-head shares are summed over KV heads after the parallel part, in a fixed order: the result does not depend
   on the number of threads. Sums are fp32. */

#pragma once

#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "block_scores_api.h"

/* float32's lowest: the logit of a place past the request's tokens (its exponential is 0) */
#define PAST_END (-3.40282346638528859812e+38f)
#define QUERY_TILE 4 /* query heads whose sums a pass over a tile of keys keeps at once */

static inline int64_t padded(int64_t x) { return (x + 15) / 16 * 16; }

typedef struct {
  const char *query, *keys;
  const int64_t *blocks, *seq_lens;
  int64_t Q, H, G, D, key_block, key_head, key_channel, block_size, blocks_row, K, bytes;
  float scale;
} block_args;

/* acc[g] = q_g . keys[:, t .. t + LANES) over the D channels for GT <= QUERY_TILE query heads (channel d's tokens at
   keys + d * key_channel; q the heads in fp32, pairs as bf16 pairs): the unit defines it after this header. */
static inline __attribute__((always_inline)) void key_tile(const char *keys, int64_t key_channel, int64_t t,
                                                           int64_t D, int64_t bytes, const float *q,
                                                           const uint32_t *pairs, const int GT,
                                                           vf acc[QUERY_TILE]);

static inline int64_t query_floats(int64_t G, int64_t D) { return padded(G * D) + padded(G * D); }
static inline int64_t row_floats(int64_t G, int64_t K, int64_t block_size, int64_t D) {
  return query_floats(G, D) + G * K * block_size + padded(K);
}

/* The Q x G query heads of KV head h of request r (query i's head g at row i * G + g), widened to fp32, and as bf16 pairs (channels 2i, 2i+1 of a head
   in one 32-bit word, low half first: what VDPBF16PS takes; only the bf16 variant reads them). */
static void prepare_queries(const block_args *a, int64_t r, int64_t h, float *q, uint32_t *pairs) {
  const int64_t G = a->G, D = a->D;
  for (int64_t g = 0; g < a->Q * G; g++) {
    const char *row = a->query + (((r * a->Q + g / G) * a->H + h) * G + g % G) * D * a->bytes;
    for (int64_t d = 0; d < D; d++) q[g * D + d] = element(row, d, a->bytes);
    if (a->bytes == 2)
      for (int64_t i = 0; i < D / 2; i++) {
        const uint16_t *halves = (const uint16_t *)row + 2 * i;
        pairs[g * (D / 2) + i] = (uint32_t)halves[0] | ((uint32_t)halves[1] << 16);
      }
  }
}

static inline __attribute__((always_inline)) void logits_tiles(const block_args *a, const char *block_keys,
                                                                const float *q, const uint32_t *pairs, const int GT,
                                                                float *logits, int64_t columns) {
  for (int64_t t = 0; t < a->block_size; t += LANES) {
    vf acc[QUERY_TILE];
    key_tile(block_keys, a->key_channel, t, a->D, a->bytes, q, pairs, GT, acc);
    for (int g = 0; g < GT; g++) vstore(logits + g * columns + t, vmul(acc[g], vset1(a->scale)));
  }
}

/* The row's share of each of its blocks' attention, summed over its Q x G query heads, into shares[0, K). */
static void score_row(const block_args *a, int64_t r, int64_t h, float *work, float *shares) {
  const int64_t G = a->Q * a->G, D = a->D, bs = a->block_size, columns = a->K * bs;
  int64_t S = a->seq_lens[r];
  if (S > columns) S = columns;
  memset(shares, 0, a->K * sizeof(float));
  if (S <= 0) return;
  const int64_t used = (S + bs - 1) / bs;
  float *q = work;
  uint32_t *pairs = (uint32_t *)(work + padded(G * D));
  float *logits = work + query_floats(G, D);
  float *block_sums = logits + G * columns;
  prepare_queries(a, r, h, q, pairs);
  for (int64_t j = 0; j < used; j++) {
    const char *block_keys = a->keys + (a->blocks[r * a->blocks_row + j] * a->key_block + h * a->key_head) * a->bytes;
    for (int64_t g0 = 0; g0 < G; g0 += QUERY_TILE) {
      float *rows = logits + g0 * columns + j * bs;
      const float *qg = q + g0 * D;
      const uint32_t *pg = pairs + g0 * (D / 2);
      switch (G - g0 < QUERY_TILE ? G - g0 : QUERY_TILE) {
      case 1: logits_tiles(a, block_keys, qg, pg, 1, rows, columns); break;
      case 2: logits_tiles(a, block_keys, qg, pg, 2, rows, columns); break;
      case 3: logits_tiles(a, block_keys, qg, pg, 3, rows, columns); break;
      default: logits_tiles(a, block_keys, qg, pg, 4, rows, columns); break;
      }
    }
  }
  const int64_t end = used * bs;
  for (int64_t g = 0; g < G; g++) {
    float *row = logits + g * columns;
    const int64_t seen = S - a->Q + g / a->G + 1; /* (causal: query i sees the places up to its own) */
    for (int64_t t = seen > 0 ? seen : 0; t < end; t++) row[t] = PAST_END;
    vf top = vset1(PAST_END);
    for (int64_t t = 0; t < end; t += LANES) top = vmax(top, vload(row + t));
    const vf largest = vset1(vhmax(top));
    float total = 0.0f;
    for (int64_t j = 0; j < used; j++) {
      vf sum = vzero();
      for (int64_t t = j * bs; t < (j + 1) * bs; t += LANES) sum = vadd(sum, vexp(vload(row + t) - largest));
      block_sums[j] = vhsum(sum);
      total += block_sums[j];
    }
    const float inverse = 1.0f / total;
    for (int64_t j = 0; j < used; j++) shares[j] += block_sums[j] * inverse;
  }
}

int64_t h2ochat_block_scores_workspace(int64_t R, int64_t Q, int64_t H, int64_t G, int64_t K, int64_t block_size,
                                       int64_t D, int threads) {
  return (threads < 1 ? 1 : threads) * row_floats(Q * G, K, block_size, D) + R * H * K;
}

void h2ochat_block_scores(int64_t query, int64_t R, int64_t Q, int64_t H, int64_t G, int64_t D, int64_t keys, int64_t key_block,
                          int64_t key_head, int64_t key_channel, int64_t block_size, int64_t blocks,
                          int64_t blocks_row, int64_t K, int64_t seq_lens, float scale, int64_t out, int64_t bytes,
                          int64_t workspace_address, int threads) {
  const block_args a = {(const char *)query, (const char *)keys, (const int64_t *)blocks, (const int64_t *)seq_lens,
                        Q, H, G, D, key_block, key_head, key_channel, block_size, blocks_row, K, bytes, scale};
  float *workspace = (float *)workspace_address;
  const int64_t per_thread = row_floats(Q * G, K, block_size, D), rows = R * H;
  float *shares = workspace + (threads < 1 ? 1 : threads) * per_thread; /* [R, H, K] */
#ifdef _OPENMP
  if (threads > 1 && rows > 1) {
#pragma omp parallel num_threads(threads)
    {
      float *work = workspace + omp_get_thread_num() * per_thread;
#pragma omp for schedule(dynamic, 1)
      for (int64_t row = 0; row < rows; row++) score_row(&a, row / H, row % H, work, shares + row * K);
    }
  } else
#endif
    for (int64_t row = 0; row < rows; row++) score_row(&a, row / H, row % H, workspace, shares + row * K);
  float *result = (float *)out;
  for (int64_t r = 0; r < R; r++)
    for (int64_t j = 0; j < K; j++) {
      float sum = 0.0f;
      for (int64_t h = 0; h < H; h++) sum += shares[(r * H + h) * K + j];
      result[r * K + j] = sum;
    }
}
