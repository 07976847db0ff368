/* The recall step's host-side work for a CPU whose cold store is in the step's memory (AVX512-BF16).

   h2ochat_page_best_bf16: the exact selector's page scores (recall_reference.page_scores with the keys
   themselves, bits None): for each (sequence b, KV head h) and page n of `page` slots,
     out[b, h, n] = max over valid slots t of the page, over queries m, of sum_d q[b, h, m, d] * k[b, h, t, d]
   (-inf where the page has no valid slot). bf16 products are exact in fp32 and summed in fp32 by
   VDPBF16PS: the same sums as the torch reference's fp32 product, up to the order they are added in
   (the reference materialises fp32 copies of the keys and the [M, T] dots, then two maxima).

   Keys are read where the store keeps them: [B, H, T, D] with any strides but a unit one along D (the
   store's leading slots, a view). Queries [B, H, M, D] and valid [B, H, T] (bytes) contiguous.

   Built and loaded by native.py (through engine/row_products.py's builder). */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define LOAD(p) ((__m512bh)_mm512_loadu_si512(p))
#define LOAD_MASKED(mask, p) ((__m512bh)_mm512_maskz_loadu_epi16((mask), (p)))

/* q . k of one key against M queries (D bf16 each), the best of them. */
static inline float best_dot(const uint16_t *key, const uint16_t *q, int64_t M, int64_t D) {
  const int64_t full = D / 32, tail = D % 32;
  const __mmask32 tail_mask = (__mmask32)((1ull << tail) - 1u);
  float best = -INFINITY;
  for (int64_t m = 0; m < M; m++) {
    const uint16_t *qm = q + m * D;
    __m512 acc = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c < full; c++) acc = _mm512_dpbf16_ps(acc, LOAD(key + c * 32), LOAD(qm + c * 32));
    if (tail) acc = _mm512_dpbf16_ps(acc, LOAD_MASKED(tail_mask, key + c * 32), LOAD_MASKED(tail_mask, qm + c * 32));
    const float dot = _mm512_reduce_add_ps(acc);
    if (dot > best) best = dot;
  }
  return best;
}

/* The best dot of slots [first, last) of one (sequence, head)'s keys (-inf: none valid); valid NULL: all are. */
static inline float slots_best(const uint16_t *keys, int64_t key_t, const uint8_t *valid, int64_t first,
                               int64_t last, const uint16_t *q, int64_t M, int64_t D) {
  float best = -INFINITY;
  for (int64_t t = first; t < last; t++) {
    if (valid && !valid[t]) continue;
    const float dot = best_dot(keys + t * key_t, q, M, D);
    if (dot > best) best = dot;
  }
  return best;
}

void h2ochat_page_best_bf16(const uint16_t *q, int64_t B, int64_t H, int64_t M, int64_t D, const uint16_t *keys,
                            int64_t key_b, int64_t key_h, int64_t key_t, const uint8_t *valid, int64_t T,
                            int64_t page, float *out) {
  const int64_t pages = T / page;
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = b * H + h;
      for (int64_t n = 0; n < pages; n++)
        out[row * pages + n] = slots_best(keys + b * key_b + h * key_h, key_t, valid + row * T, n * page,
                                          (n + 1) * page, q + row * M * D, M, D);
    }
}

/* The best k pages of an append-only store that never wraps (slot n holds the n-th token; slots at or
   past count[b, h] are empty), scoring the first T slots: their page numbers, best first, -1 past the
   pages that hold a token (torch.topk of page_best's scores with -inf masked to -1; equal scores in
   page order). wanted: [B, H, k]. */
void h2ochat_top_pages_bf16(const uint16_t *q, int64_t B, int64_t H, int64_t M, int64_t D, const uint16_t *keys,
                            int64_t key_b, int64_t key_h, int64_t key_t, const int64_t *count, int64_t T,
                            int64_t page, int64_t k, int64_t *wanted) {
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = b * H + h;
      int64_t *top = wanted + row * k;
      float top_score[k > 0 ? k : 1];
      int64_t held = 0;
      const int64_t filled = count[row] < T ? count[row] : T;
      for (int64_t n = 0; n * page < filled; n++) {
        const int64_t last = (n + 1) * page < filled ? (n + 1) * page : filled;
        const float score = slots_best(keys + b * key_b + h * key_h, key_t, NULL, n * page, last, q + row * M * D, M, D);
        if (score == -INFINITY) continue;
        int64_t at = held < k ? held++ : k;
        while (at > 0 && score > top_score[at - 1]) {
          if (at < k) top[at] = top[at - 1], top_score[at] = top_score[at - 1];
          at--;
        }
        if (at < k) top[at] = n, top_score[at] = score;
      }
      for (int64_t j = held; j < k; j++) top[j] = -1;
    }
}
