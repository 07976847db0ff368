/* A few rows of bf16 activations times a plain bf16 weight, for CPUs with AVX512-BF16.

   y[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]): nn.Linear's product, with w in its own row-major
   [N, K] layout (no packed copy), products summed in fp32 by VDPBF16PS and rounded once to
   nearest-even, as oneDNN's bf16 product rounds.

   Why: a decode step multiplies one to a few rows by every weight, so its time is the time to read the
   weights. Read as one sequential stream per thread, SmolLM2-135M's 211 weights come in at ~25 GB/s
   on one core of an AMD EPYC, where oneDNN's packed bf16 product reaches about half that
   (benchmarks/results_packed_linears_*.json). Reading two or more weight rows side by side (two
   streams) halved the rate there, so each thread walks its weight rows one at a time, and the x
   rows, a few KB, stay in L1.

   Built at install with -mavx512f -mavx512bw -mavx512bf16 -fopenmp (h2ochat_kernels/cpu/variants.py); bound by
   h2ochat_kernels/cpu/row_products.py where the CPU has avx512_bf16. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "rows_api.h"

#define LOAD(p) ((__m512bh)_mm512_loadu_si512(p))
#define WEIGHT_ROWS_AT_ONCE 4 /* past four x rows: weight rows taken this many at a time (a few KB, kept in L1) */
#define LOAD_MASKED(mask, p) ((__m512bh)_mm512_maskz_loadu_epi16((mask), (p)))

static inline uint16_t to_bf16(float value) {
  uint32_t bits;
  memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
  bits += 0x7fffu + ((bits >> 16) & 1u);                                            /* nearest, ties to even */
  return (uint16_t)(bits >> 16);
}

static inline float from_bf16(uint16_t half) {
  uint32_t bits = (uint32_t)half << 16;
  float value;
  memcpy(&value, &bits, 4);
  return value;
}

/* Weight rows [first, last) against ROWS (1 to 4, a constant once inlined) rows of x: two
   accumulator chains per x row over alternate 32-column chunks, the last chunk masked. */
static inline __attribute__((always_inline)) void rows_against(
    const int ROWS, const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t first, int64_t last,
    int64_t K, const uint16_t *bias, uint16_t *y, int64_t y_stride) {
  const int64_t full = K / 32, tail = K % 32;
  const __mmask32 tail_mask = (__mmask32)((1ull << tail) - 1u);
  for (int64_t n = first; n < last; n++) {
    const uint16_t *row = w + n * K;
    __m512 even[4], odd[4];
    for (int m = 0; m < ROWS; m++) even[m] = odd[m] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= full; c += 2) {
      const __m512bh w0 = LOAD(row + c * 32), w1 = LOAD(row + c * 32 + 32);
      for (int m = 0; m < ROWS; m++) {
        even[m] = _mm512_dpbf16_ps(even[m], w0, LOAD(x + m * x_stride + c * 32));
        odd[m] = _mm512_dpbf16_ps(odd[m], w1, LOAD(x + m * x_stride + c * 32 + 32));
      }
    }
    if (c < full) {
      const __m512bh w0 = LOAD(row + c * 32);
      for (int m = 0; m < ROWS; m++) even[m] = _mm512_dpbf16_ps(even[m], w0, LOAD(x + m * x_stride + c * 32));
      c++;
    }
    if (tail) {
      const __m512bh w0 = LOAD_MASKED(tail_mask, row + c * 32);
      for (int m = 0; m < ROWS; m++)
        odd[m] = _mm512_dpbf16_ps(odd[m], w0, LOAD_MASKED(tail_mask, x + m * x_stride + c * 32));
    }
    const float b = bias ? from_bf16(bias[n]) : 0.0f;
    for (int m = 0; m < ROWS; m++) y[m * y_stride + n] = to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m])) + b);
  }
}

/* Every x row against weight rows [first, last), a few weight rows at a time: the x rows' groups of four take
   turns on the same weight rows while those are still in L1, so each weight is read from memory once whatever M. */
static void weight_rows(const uint16_t *x, int64_t M, int64_t x_stride, const uint16_t *w, int64_t first,
                        int64_t last, int64_t K, const uint16_t *bias, uint16_t *y, int64_t y_stride) {
  const int64_t step = M <= 4 ? last - first : WEIGHT_ROWS_AT_ONCE;
  for (int64_t n = first; n < last; n += step) {
    const int64_t until = n + step < last ? n + step : last;
    for (int64_t m = 0; m < M; m += 4) {
      const uint16_t *xs = x + m * x_stride;
      uint16_t *ys = y + m * y_stride;
      switch (M - m < 4 ? M - m : 4) {
        case 1: rows_against(1, xs, x_stride, w, n, until, K, bias, ys, y_stride); break;
        case 2: rows_against(2, xs, x_stride, w, n, until, K, bias, ys, y_stride); break;
        case 3: rows_against(3, xs, x_stride, w, n, until, K, bias, ys, y_stride); break;
        default: rows_against(4, xs, x_stride, w, n, until, K, bias, ys, y_stride); break;
      }
    }
  }
}

/* x: M rows of K bf16 values, x_stride apart; w: N rows of K; bias: N values or NULL; y: M rows of N,
   y_stride apart. The weight rows are split among `threads` OpenMP threads in blocks of 64. */
void h2ochat_rows_bf16(const uint16_t *x, int64_t M, int64_t x_stride, const uint16_t *w, int64_t N, int64_t K,
                       const uint16_t *bias, uint16_t *y, int64_t y_stride, int threads) {
  const int64_t block = 64, blocks = (N + block - 1) / block;
  if (threads <= 1 || blocks < 2) {
    weight_rows(x, M, x_stride, w, 0, N, K, bias, y, y_stride);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t last = (b + 1) * block < N ? (b + 1) * block : N;
    weight_rows(x, M, x_stride, w, b * block, last, K, bias, y, y_stride);
  }
}
