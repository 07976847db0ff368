/* The block_scores module's entry points: the one list of their types. Each variant's unit includes it (so the
   compiler holds each definition to it) and h2ochat_kernels/cpu/binding.py hands it to cffi. Plain declarations
   only: cffi reads this file as it is.

   The attention a step's last Q queries of each request (Q = 1: a decode step) give each of its kept KV blocks, read in place from vLLM's CPU
   key cache (keys of a block and KV head stored channel-major: channel d's block_size tokens side by side).
   h2ochat_kernels/cpu/block_scores_ops.py says what each argument is. Strides are in elements; `bytes` is 2 for
   bf16 queries and keys, 4 for fp32. Tensors go by address (int64_t): one call a layer, no per-pointer casts. */

int64_t h2ochat_block_scores_workspace(int64_t R, int64_t Q, int64_t H, int64_t G, int64_t K, int64_t block_size, int64_t D, int threads);
void h2ochat_block_scores(int64_t query, int64_t R, int64_t Q, int64_t H, int64_t G, int64_t D, int64_t keys, int64_t key_block, int64_t key_head, int64_t key_channel, int64_t block_size, int64_t blocks, int64_t blocks_row, int64_t K, int64_t seq_lens, float scale, int64_t out, int64_t bytes, int64_t workspace, int threads);
