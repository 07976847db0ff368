/* The row module's entry point (see recall_api.h for how this list is used). */

void h2ochat_rows_bf16(const uint16_t *x, int64_t M, int64_t x_stride, const uint16_t *w, int64_t N, int64_t K, const uint16_t *bias, uint16_t *y, int64_t y_stride, int threads);
