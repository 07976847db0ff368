/* The attention module's entry points: the one list of their types. Each variant's unit includes it (so the
   compiler holds each definition to it) and h2ochat_kernels/cpu/binding.py hands it to cffi. Plain declarations
   only: cffi reads this file as it is.

   A decode step's attention over a layer's float slots with its H2O scores, in one read of the keys and values
   (h2ochat_kernels/cpu/attention_ops.py says what each argument is). Strides are in elements; `bytes` is 2 for
   bf16 queries, keys and values, 4 for fp32. */

int64_t h2ochat_attend_workspace(int64_t G, int64_t S, int64_t D);
void h2ochat_attend_decode(const void *query, int64_t B, int64_t H, int64_t G, int64_t D, const void *keys, int64_t key_b, int64_t key_h, int64_t key_s, const void *values, int64_t value_b, int64_t value_h, int64_t value_s, int64_t S, const int64_t *token_index, int64_t index_b, int64_t index_h, int64_t index_s, const void *new_keys, const void *new_values, const uint8_t *new_valid, float scale, float *scores, int64_t score_b, int64_t score_h, int64_t score_s, const float *decay, void *out, float *new_scores, int64_t bytes, float *workspace, int threads);
