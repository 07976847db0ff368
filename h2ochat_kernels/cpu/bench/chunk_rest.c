/* A prompt chunk's page scores and rest weights in the recall kernels (chunk_weights, csrc/rest.h), timed alone:
   M queries of one (row, KV head) against T cold keys of 64 channels, pages of 8, the best of 7 calls, and a
   checksum of everything it wrote (the same sums give the same checksum). Built against one variant's unit, so
   variants, or two commits' units, can be timed side by side:

     cd h2ochat_kernels/cpu
     cc -O3 -mavx2 -mfma -Icsrc -DKERNEL='"recall_portable.c"' bench/chunk_rest.c -o after -lm
     for i in 1 2 3; do taskset -c 1 ./after 900 1203 2; done

   Arguments: M (queries: a 300-token chunk of a 3-query-head group is 900), T (cold keys), bytes (2: bf16
   keys and queries, 4: fp32). One line of JSON out. Figures: benchmarks/results_recall_chunk_rest_*.json. */
#include KERNEL
#include <stdio.h>
#include <time.h>

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void fill(void *out, int64_t n, int64_t bytes) {
  for (int64_t i = 0; i < n; i++) {
    const float x = rand() / (float)RAND_MAX - 0.5f;
    if (bytes == 2) ((uint16_t *)out)[i] = to_bf16(x);
    else ((float *)out)[i] = x;
  }
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s QUERIES KEYS BYTES\n", argv[0]);
    return 2;
  }
  const int64_t M = atoll(argv[1]), T = atoll(argv[2]), bytes = atoll(argv[3]), D = 64, P = 8;
  const int64_t stride = (T + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK + KEY_BLOCK, pages = (T + P - 1) / P;
  void *q = malloc(M * D * bytes), *keys = malloc(T * D * bytes);
  float *dots = malloc(REST_QUERY_BLOCK * stride * sizeof(float)), *scores = malloc(pages * sizeof(float));
  float *weights = malloc(M * pages * sizeof(float)), *top = malloc(M * sizeof(float)), *scratch;
  srand(1);
  fill(q, M * D, bytes);
  fill(keys, T * D, bytes);
  if (!scratch_for(bytes, M, D, &scratch)) return 1;
  float *blocks = malloc((blocks_floats(bytes, T, D) + 1) * sizeof(float));
  double best = 1e30, checksum = 0.0;
  for (int r = 0; r < 7; r++) {
    const double start = seconds();
    chunk_weights(q, bytes, M, D, keys, D, T, P, 0.125f, scores, dots, stride, top, weights, scratch,
                  blocks_floats(bytes, T, D) ? blocks : NULL);
    const double took = seconds() - start;
    best = took < best ? took : best;
  }
  for (int64_t i = 0; i < M * pages; i++) checksum += weights[i];
  for (int64_t n = 0; n < pages; n++) checksum += scores[n];
  for (int64_t m = 0; m < M; m++) checksum += top[m];
  printf("{\"queries\": %lld, \"keys\": %lld, \"bytes\": %lld, \"best_ms\": %.4f, \"checksum\": %.9g}\n",
         (long long)M, (long long)T, (long long)bytes, best * 1e3, checksum);
  return 0;
}
