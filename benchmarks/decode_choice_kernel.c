/* A decode step's page choice in the recall kernel (top_pages_row of h2ochat/recall/recall_kernel.c), timed alone:
   M queries of one (row, KV head) against T bf16 cold keys of 64 channels, pages of 8, the best 8 pages, over NB
   separate key buffers (as a step reads every layer's and head's store: 90 buffers of 7,900 keys are 91 MB, past
   any cache), the best of 5 passes. Prints nanoseconds a key and the bytes of keys read a second.

     cc -O3 -mavx2 -mfma -DKERNEL='"../h2ochat/recall/recall_kernel.c"' benchmarks/decode_choice_kernel.c -o choice -lm
     taskset -c 1 ./choice 7900 90 3   # an 8K step's stores (30 layers x 3 KV heads), SmolLM2's query group of 3
     taskset -c 1 ./choice 7900 2 3    # the same keys from the last-level cache

   Session 68 (AVX2 Zen 3, four runs each): 13.8-16.5 ns a key from memory (~8-9 GB/s of keys), 12.5-20 from the
   L3, 10.8-17 from the L2 (1,000 keys x 4); a plain AVX2 read of the same memory streams 15-25 GB/s, so the
   choice is bound by its work per key (~5 ns of it FMAs), not by memory. Inside the 8K step the whole call took
   ~18 ns a key.

   Session 69, the portable build's few-query route rewritten (pair_few_scores: each key's bf16 channels split in
   place by a shift and a mask, groups of 4 keys read once for the 3 queries), same machine, the best of 60 passes
   (12 from memory), three runs each, old and new alternated: from the L2 10.6-10.8 -> 7.9-8.0 ns a key (1.35x);
   from memory, with a prefetch 16 keys ahead, 13.9-15.3 -> 10.7-11.6 (1.3x). By query count (L2): 1 query
   9.0 -> 4.0, 2: 9.4 -> 6.0, 4: 12.4 -> 10.2, 6 and 8: about even (15.8/14.9, 18.8/19.3). Each query adds ~2 ns a
   key (8 FMAs and its share of the folds): at 3 queries the FMAs alone are about half of the 8 ns.

   Session 70: a fourth argument, 4, times fp32 keys (the store of --cold-dtype model on an fp32 model; auto's
   keeps bf16 keys there). The same machine, shared and slower that day, 1,000 keys x 2 from the L2, 3 queries,
   the least of 20 runs alternated: fp32 keys 15.3 ns a key, bf16 11.1. Reading the fp32 keys in groups of 4
   for the 3 queries as the bf16 route does (pair_sums taking either width) measured 16.1 for fp32 and 13.0 for
   bf16 (its medians 17.7 / 17.1 against 15.9 / 13.8) and was not kept. */
#include KERNEL
#include <stdio.h>
#include <time.h>

/* Value i of a buffer of `bytes`-wide floats: uniform in [-0.5, 0.5]. */
static void set_random(void *values, int64_t i, int64_t bytes) {
  const float x = rand() / (float)RAND_MAX - 0.5f;
  if (bytes == 2) ((uint16_t *)values)[i] = to_bf16(x);
  else ((float *)values)[i] = x;
}

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  const int64_t bytes = argc == 5 ? atoll(argv[4]) : 2;
  if ((argc != 4 && argc != 5) || (bytes != 2 && bytes != 4)) {
    fprintf(stderr, "usage: %s KEYS BUFFERS QUERIES [BYTES: 2 bf16, the default, or 4 fp32]\n", argv[0]);
    return 2;
  }
  const int64_t T = atoll(argv[1]), NB = atoll(argv[2]), M = atoll(argv[3]), D = 64, P = 8, k = 8;
  void **keys = malloc(NB * sizeof *keys), *q = malloc(M * D * bytes);
  srand(1);
  for (int64_t b = 0; b < NB; b++) {
    keys[b] = malloc(T * D * bytes);
    for (int64_t i = 0; i < T * D; i++) set_random(keys[b], i, bytes);
  }
  for (int64_t i = 0; i < M * D; i++) set_random(q, i, bytes);
  float *scratch;
  if (!scratch_for(bytes, M, D, &scratch)) return 1;
  int64_t top[8], check = 0;
  double best = 1e30;
  for (int pass = 0; pass < 5; pass++) {
    const double start = seconds();
    for (int64_t b = 0; b < NB; b++) {
      top_pages_row(q, bytes, M, D, keys[b], D, T, T, P, k, top, NULL, 0, scratch);
      check += top[0];
    }
    const double took = seconds() - start;
    best = took < best ? took : best;
  }
  printf("{\"keys\": %lld, \"buffers\": %lld, \"queries\": %lld, \"ns_per_key\": %.2f, \"gb_per_s\": %.2f, "
         "\"bytes\": %lld, \"check\": %lld}\n", (long long)T, (long long)NB, (long long)M, best / (T * NB) * 1e9,
         T * NB * D * bytes / best / 1e9, (long long)bytes, (long long)check);
  return 0;
}
