/* A decode step's attention with its H2O scores, one (sequence, KV head) row at a time: what every variant of the
   attention module shares. The unit that includes this defines the vector kind first: LANES fp32 lanes in `vf`,
   its arithmetic (vzero ... vhmax, vround, vscale2, vzero_below) and the three loops that touch the slots and
   queries (prepare_queries, key_dots, value_sums): attention_avx512bf16.c by AVX-512 and VDPBF16PS,
   attention_portable.c by vectors of 8 floats.

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
#define ROW_PAD 16     /* a row of logits holds whole blocks of keys and the new token's block after them */

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
static inline int64_t logit_columns(int64_t S) { return round_up(S, ROW_PAD) + ROW_PAD; }
static inline int64_t value_columns(int64_t D) { return round_up(D, 64); }

static inline float from_bf16(uint16_t half) {
  const uint32_t bits = (uint32_t)half << 16;
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

/* x as bf16, to nearest even as torch's .to(torch.bfloat16); a NaN stays a quiet NaN. */
static inline uint16_t to_bf16(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* exp(x) for x <= 0 (a logit less the row's largest): 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], p the Taylor
   series to r^7 (its error below 1e-8, under fp32's rounding); below EXP_LOW (where exp leaves fp32's normal range)
   0, as near as torch's denormals to be no different in a sum whose largest term is 1. */
#define EXP_LOW (-87.0f)
static inline vf vexp(vf x) {
  const vf clamped = vmax(x, vset1(EXP_LOW));
  const vf n = vround(vmul(clamped, vset1(1.44269504088896341f)));
  vf r = vfma(n, vset1(-0.693145751953125f), clamped); /* ln 2 in two parts: n * the first is exact */
  r = vfma(n, vset1(-1.42860682030941723212e-6f), r);
  vf p = vset1(1.0f / 5040.0f);
  p = vfma(p, r, vset1(1.0f / 720.0f));
  p = vfma(p, r, vset1(1.0f / 120.0f));
  p = vfma(p, r, vset1(1.0f / 24.0f));
  p = vfma(p, r, vset1(1.0f / 6.0f));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.0f));
  p = vfma(p, r, vset1(1.0f));
  return vzero_below(x, EXP_LOW, vscale2(p, n));
}

/* What the unit defines after this header: the queries laid out for its dots (`value_columns(D)` elements a
   query, zero past D); the raw q.k of every query with n <= LANES keys into lanes [0, LANES) of each query's row of
   logits (lanes past n: 0); and acc[g] += sum_j p[g][j] * value_j over n values. */
static void prepare_queries(const char *q, int64_t G, int64_t D, int64_t bytes, float *prepared);
static void key_dots(const char *keys, int64_t key_s, int64_t n, const float *prepared, int64_t G, int64_t D,
                     int64_t bytes, float *logits, int64_t columns);
static void value_sums(const char *values, int64_t value_s, int64_t n, const float *p, int64_t columns, int64_t G,
                       int64_t D, int64_t bytes, float *acc, int64_t width);

typedef struct {
  const char *query, *keys, *values, *new_keys, *new_values;
  int64_t H, G, D, S, bytes, key_b, key_h, key_s, value_b, value_h, value_s, index_b, index_h, index_s;
  int64_t score_b, score_h, score_s;
  const int64_t *token_index;
  const uint8_t *new_valid;
  const float *decay;
  float scale, *scores, *new_scores;
  char *out;
} step_t;

int64_t h2ochat_attend_workspace(int64_t G, int64_t S, int64_t D) {
  return G * logit_columns(S) + logit_columns(S) + 2 * G * value_columns(D);
}

/* Row (b, h): its logits (G rows of `columns`, the new token's at column S), then their softmax in place, then the
   values by those probabilities, then the scores. */
static void attend_row(const step_t *t, int64_t b, int64_t h, float *work) {
  const int64_t G = t->G, D = t->D, S = t->S, bytes = t->bytes, columns = logit_columns(S), width = value_columns(D);
  float *logits = work, *bias = logits + G * columns, *acc = bias + columns, *prepared = acc + G * width;
  const int64_t row = b * t->H + h;
  const int real = !t->new_valid || t->new_valid[b];

  prepare_queries(t->query + row * G * D * bytes, G, D, bytes, prepared);
  const char *keys = t->keys + (b * t->key_b + h * t->key_h) * bytes;
  for (int64_t s0 = 0; s0 < S; s0 += LANES)
    key_dots(keys + s0 * t->key_s * bytes, t->key_s, S - s0 < LANES ? S - s0 : LANES, prepared, G, D, bytes,
             logits + s0, columns);
  key_dots(t->new_keys + row * D * bytes, 0, 1, prepared, G, D, bytes, logits + S, columns);

  /* scale * dot + bias: MASKED for an empty slot (the sum rounds to it) and a padding token's own key, -inf past
     the new token (no probability at all) */
  const int64_t *index = t->token_index + b * t->index_b + h * t->index_h;
  for (int64_t s = 0; s < S; s++) bias[s] = index[s * t->index_s] < 0 ? MASKED : 0.0f;
  bias[S] = real ? 0.0f : MASKED;
  for (int64_t s = S + 1; s < columns; s++) bias[s] = -INFINITY;
  float inverse[G];
  for (int64_t g = 0; g < G; g++) {
    float *x = logits + g * columns;
    for (int64_t s = S + 1; s < columns; s++) x[s] = 0.0f; /* (never written: whatever the workspace held) */
    vf top = vset1(-INFINITY);
    for (int64_t s = 0; s < columns; s += LANES) {
      const vf logit = vfma(vload(x + s), vset1(t->scale), vload(bias + s));
      vstore(x + s, logit);
      top = vmax(top, logit);
    }
    const vf largest = vset1(vhmax(top));
    vf sum = vzero();
    for (int64_t s = 0; s < columns; s += LANES) {
      const vf p = vexp(vadd(vload(x + s), vmul(largest, vset1(-1.0f))));
      vstore(x + s, p);
      sum = vadd(sum, p);
    }
    inverse[g] = 1.0f / vhsum(sum);
  }

  memset(acc, 0, G * width * sizeof(float));
  const char *values = t->values + (b * t->value_b + h * t->value_h) * bytes;
  for (int64_t s0 = 0; s0 < S; s0 += VALUE_BLOCK)
    value_sums(values + s0 * t->value_s * bytes, t->value_s, S - s0 < VALUE_BLOCK ? S - s0 : VALUE_BLOCK,
               logits + s0, columns, G, D, bytes, acc, width);
  value_sums(t->new_values + row * D * bytes, 0, 1, logits + S, columns, G, D, bytes, acc, width);
  for (int64_t g = 0; g < G; g++) {
    const float *from = acc + g * width;
    char *to = t->out + (row * G + g) * D * bytes;
    if (bytes == 4)
      for (int64_t d = 0; d < D; d++) ((float *)to)[d] = from[d] * inverse[g];
    else
      for (int64_t d = 0; d < D; d++) ((uint16_t *)to)[d] = to_bf16(from[d] * inverse[g]);
  }

  /* the probability each slot received, summed over the G queries (into the first row), onto the scores:
     S <- decay * S + p for a real token; a padding token neither adds nor decays */
  for (int64_t s = 0; s < columns; s += LANES) {
    vf received = vmul(vload(logits + s), vset1(inverse[0]));
    for (int64_t g = 1; g < G; g++) received = vfma(vload(logits + g * columns + s), vset1(inverse[g]), received);
    vstore(logits + s, received);
  }
  t->new_scores[row] = real ? logits[S] : 0.0f;
  if (!real) return;
  float *scores = t->scores + b * t->score_b + h * t->score_h;
  const float decay = t->decay ? t->decay[b] : 1.0f;
  if (decay == 1.0f)
    for (int64_t s = 0; s < S; s++) scores[s * t->score_s] += logits[s];
  else
    for (int64_t s = 0; s < S; s++) scores[s * t->score_s] = scores[s * t->score_s] * decay + logits[s];
}

void h2ochat_attend_decode(int64_t query, int64_t B, int64_t H, int64_t G, int64_t D, int64_t keys, int64_t key_b,
                           int64_t key_h, int64_t key_s, int64_t values, int64_t value_b, int64_t value_h,
                           int64_t value_s, int64_t S, int64_t token_index, int64_t index_b, int64_t index_h,
                           int64_t index_s, int64_t new_keys, int64_t new_values, int64_t new_valid, float scale,
                           int64_t scores, int64_t score_b, int64_t score_h, int64_t score_s, int64_t decay,
                           int64_t out, int64_t new_scores, int64_t bytes, int64_t workspace_address, int threads) {
  const step_t t = {(const char *)(intptr_t)query, (const char *)(intptr_t)keys, (const char *)(intptr_t)values,
                    (const char *)(intptr_t)new_keys, (const char *)(intptr_t)new_values, H, G, D, S, bytes, key_b,
                    key_h, key_s, value_b, value_h, value_s, index_b, index_h, index_s, score_b, score_h, score_s,
                    (const int64_t *)(intptr_t)token_index, (const uint8_t *)(intptr_t)new_valid,
                    (const float *)(intptr_t)decay, scale, (float *)(intptr_t)scores, (float *)(intptr_t)new_scores,
                    (char *)(intptr_t)out};
  float *workspace = (float *)(intptr_t)workspace_address;
  const int64_t rows = B * H, per_thread = h2ochat_attend_workspace(G, S, D);
  if (threads <= 1 || rows < 2) {
    for (int64_t r = 0; r < rows; r++) attend_row(&t, r / H, r % H, workspace);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  {
    float *work = workspace + omp_get_thread_num() * per_thread;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) attend_row(&t, r / H, r % H, work);
  }
#else
  (void)per_thread;
  for (int64_t r = 0; r < rows; r++) attend_row(&t, r / H, r % H, workspace);
#endif
}
