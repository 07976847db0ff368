/* The attention module's entry points: the one list of their types. Each variant's unit includes it (so the
   compiler holds each definition to it) and h2ochat_kernels/cpu/binding.py hands it to cffi. Plain declarations
   only: cffi reads this file as it is.

   Attention of Q new tokens (a decode step's one, or a prompt chunk's, causal among themselves) over a layer's
   float slots with its H2O scores, in one read of the keys and values (h2ochat_kernels/cpu/attention_ops.py says
   what each argument is). Strides are in elements; `bytes` is 2 for bf16 queries, keys and values, 4 for fp32.
   `decay`: [B] what the old scores are multiplied by (0: 1); `weights`: [B, Q] each query row's weight in the
   scores (0: 1 each); `rest_logit` [B, H, G, Q] and `rest_value` [B, H, G, Q, D], fp32 (0: none): a recall tier's
   rest column, one more logit (already scaled) and value per query row, in the softmax and the output, no score.
   The workspace: `h2ochat_attend_workspace` floats for a call with these sizes and threads. */

int64_t h2ochat_attend_workspace(int64_t B, int64_t H, int64_t G, int64_t Q, int64_t S, int64_t D, int threads);
/* Tensors by address (int64_t, 0 for none) rather than by pointer: the step calls this for every layer, and
   cffi's conversion of a dozen ints to pointers cost ~15 us a call, a tenth of the kernel at one row. */
void h2ochat_attend_tokens(int64_t query, int64_t B, int64_t H, int64_t G, int64_t Q, int64_t D, int64_t keys, int64_t key_b, int64_t key_h, int64_t key_s, int64_t values, int64_t value_b, int64_t value_h, int64_t value_s, int64_t S, int64_t token_index, int64_t index_b, int64_t index_h, int64_t index_s, int64_t new_keys, int64_t new_values, int64_t new_valid, float scale, int64_t scores, int64_t score_b, int64_t score_h, int64_t score_s, int64_t decay, int64_t weights, int64_t rest_logit, int64_t rest_value, int64_t out, int64_t new_scores, int64_t bytes, int64_t workspace, int threads);
