/* A decode step's page choice in the recall kernels (top_pages_row, csrc/page_scores.h), timed alone: M queries of
   one (row, KV head) against T cold keys of 64 channels, pages of 8, the best 8 pages, over NB separate key
   buffers (as a step reads every layer's and head's store: 90 buffers of 7,900 keys are 91 MB, past any cache),
   the best of several passes. Prints nanoseconds a key and the bytes of keys read a second. Built against one
   variant's unit, so variants (or two commits' units) can be timed side by side:

     cd h2ochat_kernels/cpu
     cc -O3 -mavx2 -mfma -Icsrc -DKERNEL='"recall_portable.c"' bench/decode_choice.c -o choice -lm
     cc -O3 -mavx512f -mavx512bw -mavx512bf16 -Icsrc -DKERNEL='"recall_avx512bf16.c"' bench/decode_choice.c -o choice512 -lm
     taskset -c 1 ./choice 7900 90 3     # an 8K step's stores (30 layers x 3 KV heads), SmolLM2's query group of 3
     taskset -c 1 ./choice 7900 2 3 4   # the same keys from the last-level cache, fp32 keys (BYTES 4)

   The choice is bound by its work per key, not by memory: a plain AVX2 read of the same memory streams faster
   than the choice reads keys. Figures: benchmarks/results_recall_*.json. */
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
