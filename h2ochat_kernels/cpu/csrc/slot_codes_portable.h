/* Quantized slot codes (slot_format.encode's, bit for bit) element by element: the same values as the
   AVX-512 variant's, each an IEEE fp32 op. */

#pragma once


static inline void store_scaled(const int8_t *codes, float scale, int64_t n, void *out, int64_t bytes) {
  for (int64_t d = 0; d < n; d++) {
    const float x = (float)codes[d] * scale;
    if (bytes == 4) ((float *)out)[d] = x;
    else ((uint16_t *)out)[d] = to_bf16(x);
  }
}

static inline float quantize(const void *values, int64_t n, int64_t value_bytes, int8_t *codes) {
  float top = 0.0f;
  for (int64_t d = 0; d < n; d++) top = larger(top, fabsf(widened(values, d, value_bytes)));
  const float scale = (top > 1e-30f ? top : 1e-30f) / 127.0f;
  for (int64_t d = 0; d < n; d++) {
    float code = rintf(widened(values, d, value_bytes) / scale);
    code = code < -127.0f ? -127.0f : code > 127.0f ? 127.0f : code;
    codes[d] = (int8_t)code;
  }
  return scale;
}

static inline void level_codes(const void *values, int64_t n, int64_t bytes, float tiny, uint8_t *codes,
                               float *scale_out, float *offset_out) {
  float offset = INFINITY, top = -INFINITY;
  for (int64_t d = 0; d < n; d++) {
    const float x = widened(values, d, bytes);
    offset = x < offset ? x : offset;
    top = larger(top, x);
  }
  float scale = (top - offset) / 255.0f;
  if (!(scale >= tiny)) scale = tiny;
  for (int64_t d = 0; d < n; d++) codes[d] = (uint8_t)(int32_t)rintf((widened(values, d, bytes) - offset) / scale);
  *scale_out = scale;
  *offset_out = offset;
}
