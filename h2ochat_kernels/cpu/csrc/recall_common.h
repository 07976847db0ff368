/* What every recall kernel shares: the key block, the decode step's query count, bf16 rounding and widening,
   and strided_t (a buffer's base and its (sequence, head, slot) strides). Compiled into every
   instruction-set variant of the recall module (recall_avx512bf16.c, recall_portable.c). */

#pragma once

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "recall_api.h"

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

static inline void *at(const strided_t *t, int64_t b, int64_t h, int64_t s, int64_t item) {
  return (char *)t->data + (b * t->b + h * t->h + s * t->s) * item;
}

