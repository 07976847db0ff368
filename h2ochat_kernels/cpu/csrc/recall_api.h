/* The recall module's entry points: the one list of their types. Every variant's unit includes it (so the
   compiler holds each definition to it) and h2ochat_kernels/cpu/binding.py hands it to cffi (so every Python
   call is checked against it). Plain declarations only: cffi reads this file as it is.

   Queries, keys and values are bf16 (elements of 2 bytes) or fp32 (4); `bytes` arguments say which. */

/* A buffer's base and its (sequence, head, slot) strides, in elements. */
typedef struct {
  void *data;
  int64_t b, h, s;
} strided_t;

int64_t h2ochat_bf16_dots(void);
int64_t h2ochat_page_best(const void *q, int64_t B, int64_t H, int64_t M, int64_t D, const void *keys, int64_t key_b, int64_t key_h, int64_t key_t, const uint8_t *valid, int64_t T, int64_t page, float *out, int64_t bytes);
int64_t h2ochat_top_pages(const void *q, int64_t B, int64_t H, int64_t M, int64_t D, const void *keys, int64_t key_b, int64_t key_h, int64_t key_t, const int64_t *count, int64_t T, int64_t page, int64_t k, int64_t *wanted, int64_t bytes);
void h2ochat_frames_update(int64_t rows, int64_t F, int64_t k, const int64_t *wanted, int64_t *frame_page, int64_t *last_used, int64_t *clock, int64_t *copied, uint8_t *complete, const int64_t *complete_pages, uint8_t *load);
void h2ochat_fill_frames(int64_t B, int64_t H, int64_t F, int64_t P, const uint8_t *load, const int64_t *frame_page, const int64_t *count, int64_t ring, const strided_t *store, const strided_t *slots, int64_t D, int64_t key_bytes, int64_t Dv, int64_t value_bytes, const strided_t *scales, float tiny);
int64_t h2ochat_recall_step(const void *q, int64_t B, int64_t H, int64_t M, int64_t D, const int64_t *count, int64_t T, int64_t P, int64_t F, int64_t *wanted, int64_t *frame_page, int64_t *last_used, int64_t *clock, int64_t *copied, uint8_t *complete, uint8_t *load, const strided_t *store, const strided_t *slots, int64_t Dv, int64_t value_bytes, const uint8_t *choosing, const strided_t *scales, float tiny, float scale, float *rest_logit, float *rest_value, float *means, int64_t N, int64_t *meaned, int64_t bytes, int64_t query_bytes);
void h2ochat_stage(int64_t B, int64_t H, int64_t P, const int64_t *slot, int64_t *count, const strided_t *sources, const strided_t *targets, int64_t D, int64_t key_bytes, int64_t Dv, int64_t value_bytes, const uint8_t *active, int64_t extras);
void h2ochat_cold_append(int64_t B, int64_t H, int64_t E, int64_t *count, int64_t capacity, const strided_t *in, const strided_t *store, int64_t D, int64_t key_bytes, int64_t Dv, int64_t value_bytes, int64_t store_key_bytes, int64_t *slots);
void h2ochat_flush(int64_t B, int64_t H, int64_t E, const uint8_t *rows, int64_t *count, int64_t capacity, const strided_t *page, const strided_t *store, int64_t D, int64_t key_bytes, int64_t Dv, int64_t value_bytes, int64_t store_key_bytes, int64_t *staged);
