/* Attention of Q new tokens with its H2O scores, one (sequence, KV head) row at a time: what every variant of the
   attention module shares. A decode step has one new token; a prompt chunk's Q attend among themselves causally,
   its G x Q queries (G-major, as the query tensor lays them out) taken as the rows of one block. The unit that
   includes this includes its vector kind first (vectors_avx512.h or vectors_portable.h, with vector_math.h's vexp
   and from_bf16) and defines the three loops that touch the slots and queries after it (prepare_queries, key_dots,
   value_sums): attention_avx512bf16.c by AVX-512 and VDPBF16PS, attention_portable.c by vectors of 8 floats.

   A row's keys are read once (their logits kept, scaled and masked, in the workspace), then its values once: the
   probabilities are known before the values are read, so the output needs no rescaling as an online softmax's
   would, and the scores come from the same kept probabilities in a light last pass. Sums are fp32. */

#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention_api.h"

/* float32's lowest: the torch route's logit for a key nobody may read (not -inf: a row with every key masked
   softmaxes to a uniform row, as torch's does, not to NaN) */
#define MASKED (-3.40282346638528859812e+38f)
#define VALUE_BLOCK 64 /* slots a value pass takes at once: each tile of queries and channels reads them from L1 */
#define ROW_PAD 16     /* a row of logits holds whole blocks of keys and the new tokens' blocks after them */

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
/* S slots, then Q new tokens from column S (a block of LANES <= ROW_PAD written at once from there) */
static inline int64_t logit_columns(int64_t S, int64_t Q) { return round_up(S + Q - 1, ROW_PAD) + ROW_PAD; }
static inline int64_t value_columns(int64_t D) { return round_up(D, 64); }

/* x as bf16, to nearest even as torch's .to(torch.bfloat16); a NaN stays a quiet NaN. */
static inline uint16_t to_bf16(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* What the unit defines after this header: the queries laid out for its dots (`value_columns(D)` elements a
   query, zero past D, each of `prepared_bytes`); the raw q.k of every query with n <= LANES keys into lanes [0, LANES) of each query's row of
   logits (lanes past n: 0); and acc[g] += sum_j p[g][j] * value_j over n values. */
static void prepare_queries(const char *q, int64_t G, int64_t D, int64_t bytes, float *prepared);
static int64_t prepared_bytes(int64_t bytes); /* the bytes of one element of a prepared query */
static void key_dots(const char *keys, int64_t key_s, int64_t n, const float *prepared, int64_t G, int64_t D,
                     int64_t bytes, float *logits, int64_t columns);
static void value_sums(const char *values, int64_t value_s, int64_t n, const float *p, int64_t columns, int64_t G,
                       int64_t D, int64_t bytes, float *acc, int64_t width);

typedef struct {
  const char *query, *keys, *values, *new_keys, *new_values;
  int64_t H, G, Q, D, S, bytes, key_b, key_h, key_s, value_b, value_h, value_s, index_b, index_h, index_s;
  int64_t score_b, score_h, score_s;
  const int64_t *token_index;
  const uint8_t *new_valid;
  const float *decay, *weights, *rest_logit, *rest_value;
  float scale, *scores, *new_scores;
  char *out;
  float *received; /* a chunk of several blocks: each unit's received attention, summed onto the scores after */
} step_t;

/* A chunk's new tokens go QUERY_BLOCK at a time: each (sequence, KV head, block) is one unit of work, so a chunk of
   one sequence keeps every thread busy, and a unit's logits (G x QUERY_BLOCK rows) stay in the CPU's cache. */
#define QUERY_BLOCK 64
static inline int64_t blocks_of(int64_t Q) { return (Q + QUERY_BLOCK - 1) / QUERY_BLOCK; }
static inline int64_t block_tokens(int64_t Q) { return Q < QUERY_BLOCK ? Q : QUERY_BLOCK; }
static inline int64_t per_thread_floats(int64_t G, int64_t Q, int64_t S, int64_t D) {
  const int64_t T = block_tokens(Q);
  return G * T * logit_columns(S, Q) + logit_columns(S, Q) + 2 * G * T * value_columns(D);
}

int64_t h2ochat_attend_workspace(int64_t B, int64_t H, int64_t G, int64_t Q, int64_t S, int64_t D, int threads) {
  const int64_t shared = blocks_of(Q) > 1 ? B * H * blocks_of(Q) * logit_columns(S, Q) : 0;
  return (threads < 1 ? 1 : threads) * per_thread_floats(G, Q, S, D) + shared;
}

/* Unit (b, h, tokens [q0, q1)): its logits (M = G x T query rows, G-major, over the S slots and the new tokens up to
   q1, from column S), then their softmax in place (a recall tier's rest column, one more logit per query row, joins
   it), then the values by those probabilities, then what each column received. */
static void attend_unit(const step_t *t, int64_t b, int64_t h, int64_t block, float *work) {
  const int64_t Q = t->Q, G = t->G, D = t->D, S = t->S, bytes = t->bytes, width = value_columns(D);
  const int64_t q0 = block * QUERY_BLOCK, q1 = q0 + QUERY_BLOCK < Q ? q0 + QUERY_BLOCK : Q, T = q1 - q0, M = G * T;
  const int64_t columns = logit_columns(S, q1), stride = logit_columns(S, Q);
  float *logits = work, *bias = logits + M * stride, *acc = bias + stride, *prepared = acc + M * width;
  const int64_t row = b * t->H + h;
  const uint8_t *valid = t->new_valid ? t->new_valid + b * Q : 0;  /* (none: every new token real) */
  const int real = !valid || valid[0];  /* (a decode step's one token) */

  for (int64_t g = 0; g < G; g++)
    prepare_queries(t->query + ((row * G + g) * Q + q0) * D * bytes, T, D, bytes,
                    (float *)((char *)prepared + g * T * width * prepared_bytes(bytes)));
  /* blocks of LANES slots that hold nothing (a recall tier's columns before pages come back, a cache not full yet):
     their logits are MASKED whatever the keys hold, so the keys are not read */
  const int64_t *index = t->token_index + b * t->index_b + h * t->index_h;
  uint8_t hollow[S / LANES + 1];
  for (int64_t s0 = 0; s0 < S; s0 += LANES) {
    int empty = 1;
    for (int64_t s = s0; s < S && s < s0 + LANES && empty; s++) empty = index[s * t->index_s] < 0;
    hollow[s0 / LANES] = (uint8_t)empty;
  }
  const char *keys = t->keys + (b * t->key_b + h * t->key_h) * bytes;
  for (int64_t s0 = 0; s0 < S; s0 += LANES) {
    if (hollow[s0 / LANES]) {
      for (int64_t m = 0; m < M; m++) memset(logits + m * stride + s0, 0, LANES * sizeof(float));
      continue;
    }
    key_dots(keys + s0 * t->key_s * bytes, t->key_s, S - s0 < LANES ? S - s0 : LANES, prepared, M, D, bytes,
             logits + s0, stride);
  }
  const char *new_keys = t->new_keys + row * Q * D * bytes;
  for (int64_t j0 = 0; j0 < q1; j0 += LANES)
    key_dots(new_keys + j0 * D * bytes, D, q1 - j0 < LANES ? q1 - j0 : LANES, prepared, M, D, bytes,
             logits + S + j0, stride);

  /* scale * dot + bias: MASKED for an empty slot (the sum rounds to it), a padding token's key and a later new
     token's (causal), -inf past the new tokens (no probability at all) */
  for (int64_t s = 0; s < S; s++) bias[s] = index[s * t->index_s] < 0 ? MASKED : 0.0f;
  for (int64_t s = S + q1; s < columns; s++) bias[s] = -INFINITY;
  float inverse[M], rest_share[M];
  int every_row_attends = 1; /* (a row with every column masked softmaxes to a uniform row: the hollow blocks too) */
  for (int64_t m = 0; m < M; m++) {
    const int64_t q = q0 + m % T, query_row = (row * G + m / T) * Q + q;
    for (int64_t j = 0; j < q1; j++) bias[S + j] = j <= q && (!valid || valid[j]) ? 0.0f : MASKED;
    float *x = logits + m * stride;
    for (int64_t s = S + q1; s < columns; s++) x[s] = 0.0f; /* (never written: whatever the workspace held) */
    vf top = vset1(-INFINITY);
    for (int64_t s = 0; s < columns; s += LANES) {
      const vf logit = vfma(vload(x + s), vset1(t->scale), vload(bias + s));
      vstore(x + s, logit);
      top = vmax(top, logit);
    }
    const float rest = t->rest_logit ? t->rest_logit[query_row] : -INFINITY;  /* (already scaled) */
    float largest_ = vhmax(top);
    if (rest > largest_) largest_ = rest;
    if (!(largest_ > MASKED)) every_row_attends = 0;
    const vf largest = vset1(largest_);
    vf sum = vzero();
    for (int64_t s = 0; s < columns; s += LANES) {
      const vf p = vexp(vadd(vload(x + s), vmul(largest, vset1(-1.0f))));
      vstore(x + s, p);
      sum = vadd(sum, p);
    }
    rest_share[m] = rest == -INFINITY ? 0.0f : expf(rest - largest_);
    inverse[m] = 1.0f / (vhsum(sum) + rest_share[m]);
  }

  memset(acc, 0, M * width * sizeof(float));
  const char *values = t->values + (b * t->value_b + h * t->value_h) * bytes;
  for (int64_t s0 = 0; s0 < S; s0 += VALUE_BLOCK) {
    int skip = every_row_attends; /* a hollow block's probabilities are all 0: it adds nothing */
    for (int64_t s = s0; s < S && s < s0 + VALUE_BLOCK && skip; s += LANES) skip = hollow[s / LANES];
    if (skip) continue;
    value_sums(values + s0 * t->value_s * bytes, t->value_s, S - s0 < VALUE_BLOCK ? S - s0 : VALUE_BLOCK,
               logits + s0, stride, M, D, bytes, acc, width);
  }
  const char *new_values = t->new_values + row * Q * D * bytes;
  for (int64_t j0 = 0; j0 < q1; j0 += VALUE_BLOCK)
    value_sums(new_values + j0 * D * bytes, D, q1 - j0 < VALUE_BLOCK ? q1 - j0 : VALUE_BLOCK, logits + S + j0,
               stride, M, D, bytes, acc, width);
  for (int64_t m = 0; m < M; m++) {
    const int64_t query_row = (row * G + m / T) * Q + q0 + m % T;
    float *from = acc + m * width;
    if (rest_share[m] != 0.0f) /* the rest's share of its value (fp32, one vector per query row) */
      for (int64_t d = 0; d < D; d++) from[d] += rest_share[m] * t->rest_value[query_row * D + d];
    char *to = t->out + query_row * D * bytes;
    if (bytes == 4)
      for (int64_t d = 0; d < D; d++) ((float *)to)[d] = from[d] * inverse[m];
    else
      for (int64_t d = 0; d < D; d++) ((uint16_t *)to)[d] = to_bf16(from[d] * inverse[m]);
  }

  /* the probability each slot and new token received, summed over the query rows, each row by its weight (a padding
     row's 0): into the first row, then onto the scores (S <- decay * S + p; a decode step's padding token neither
     adds nor decays), or, for a chunk of several blocks, into the unit's place for the sum after */
  const float *weights = t->weights ? t->weights + b * Q : 0;
  for (int64_t m = 0; m < M; m++) inverse[m] *= weights ? weights[q0 + m % T] : 1.0f;
  float *received = t->received ? t->received + (row * blocks_of(Q) + block) * stride : logits;
  for (int64_t s = 0; s < columns; s += LANES) {
    vf sum = vmul(vload(logits + s), vset1(inverse[0]));
    for (int64_t m = 1; m < M; m++) sum = vfma(vload(logits + m * stride + s), vset1(inverse[m]), sum);
    vstore(received + s, sum);
  }
  if (t->received) return;
  for (int64_t j = 0; j < Q; j++) t->new_scores[row * Q + j] = Q > 1 || real ? logits[S + j] : 0.0f;
  if (Q == 1 && !real) return;
  float *scores = t->scores + b * t->score_b + h * t->score_h;
  const float decay = t->decay ? t->decay[b] : 1.0f;
  if (decay == 1.0f)
    for (int64_t s = 0; s < S; s++) scores[s * t->score_s] += logits[s];
  else
    for (int64_t s = 0; s < S; s++) scores[s * t->score_s] = scores[s * t->score_s] * decay + logits[s];
}

/* A chunk of several blocks: row (b, h)'s units' received attention summed in block order (the same sums whatever
   the threads), onto its scores and into its new tokens' (block k holds new tokens up to its last). */
static void sum_blocks(const step_t *t, int64_t row) {
  const int64_t Q = t->Q, S = t->S, stride = logit_columns(t->S, Q), blocks = blocks_of(Q);
  const float *first = t->received + row * blocks * stride;
  float *scores = t->scores + (row / t->H) * t->score_b + (row % t->H) * t->score_h;
  const float decay = t->decay ? t->decay[row / t->H] : 1.0f;
  for (int64_t s = 0; s < S; s++) {
    float sum = 0.0f;
    for (int64_t k = 0; k < blocks; k++) sum += first[k * stride + s];
    scores[s * t->score_s] = (decay == 1.0f ? scores[s * t->score_s] : scores[s * t->score_s] * decay) + sum;
  }
  for (int64_t j = 0; j < Q; j++) {
    float sum = 0.0f;
    for (int64_t k = j / QUERY_BLOCK; k < blocks; k++) sum += first[k * stride + S + j];
    t->new_scores[row * Q + j] = sum;
  }
}

void h2ochat_attend_tokens(int64_t query, int64_t B, int64_t H, int64_t G, int64_t Q, int64_t D, int64_t keys,
                           int64_t key_b, int64_t key_h, int64_t key_s, int64_t values, int64_t value_b,
                           int64_t value_h, int64_t value_s, int64_t S, int64_t token_index, int64_t index_b,
                           int64_t index_h, int64_t index_s, int64_t new_keys, int64_t new_values, int64_t new_valid,
                           float scale, int64_t scores, int64_t score_b, int64_t score_h, int64_t score_s,
                           int64_t decay, int64_t weights, int64_t rest_logit, int64_t rest_value, int64_t out,
                           int64_t new_scores, int64_t bytes, int64_t workspace_address, int threads) {
  const int64_t blocks = blocks_of(Q), rows = B * H, units = rows * blocks;
  if (threads < 1) threads = 1;
  if (threads > units) threads = (int)units;
  const int64_t per_thread = per_thread_floats(G, Q, S, D);
  float *workspace = (float *)(intptr_t)workspace_address;
  const step_t t = {(const char *)(intptr_t)query, (const char *)(intptr_t)keys, (const char *)(intptr_t)values,
                    (const char *)(intptr_t)new_keys, (const char *)(intptr_t)new_values, H, G, Q, D, S, bytes,
                    key_b, key_h, key_s, value_b, value_h, value_s, index_b, index_h, index_s, score_b, score_h,
                    score_s, (const int64_t *)(intptr_t)token_index, (const uint8_t *)(intptr_t)new_valid,
                    (const float *)(intptr_t)decay, (const float *)(intptr_t)weights,
                    (const float *)(intptr_t)rest_logit, (const float *)(intptr_t)rest_value, scale,
                    (float *)(intptr_t)scores, (float *)(intptr_t)new_scores, (char *)(intptr_t)out,
                    blocks > 1 ? workspace + threads * per_thread : 0};
  if (threads <= 1) {
    for (int64_t u = 0; u < units; u++) attend_unit(&t, u / blocks / H, u / blocks % H, u % blocks, workspace);
    if (blocks > 1)
      for (int64_t r = 0; r < rows; r++) sum_blocks(&t, r);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  {
    float *work = workspace + omp_get_thread_num() * per_thread;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) attend_unit(&t, u / blocks / H, u / blocks % H, u % blocks, work);
    if (blocks > 1) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; r++) sum_blocks(&t, r);
    }
  }
#else
  for (int64_t u = 0; u < units; u++) attend_unit(&t, u / blocks / H, u / blocks % H, u % blocks, workspace);
  if (blocks > 1)
    for (int64_t r = 0; r < rows; r++) sum_blocks(&t, r);
#endif
}
