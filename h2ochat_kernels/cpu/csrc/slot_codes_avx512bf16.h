/* Quantized slot codes (slot_format.encode's, bit for bit) by 16-lane AVX-512 vectors. */

#pragma once

/* The lanes of the n - d values left from d (all 16 past the last chunk). */
static inline __mmask16 lanes(int64_t n, int64_t d) {
  return n - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - d)) - 1u);
}

/* 16 values (fewer: mask) from bf16 (bytes 2) or fp32 (4), as fp32; lanes past the mask read 0. */
static inline __m512 load_floats(const void *p, int64_t bytes, __mmask16 mask) {
  if (bytes == 4) return _mm512_maskz_loadu_ps(mask, p);
  const __m256i halves = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16((__mmask32)mask, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

/* out[d] = codes[d] * scale for d < n, as bf16 (bytes 2: VCVTNEPS2BF16 rounds to nearest even as torch does;
   a product of a code and a scale of max |x| / 127 is never subnormal) or fp32 (4). */
static inline void store_scaled(const int8_t *codes, float scale, int64_t n, void *out, int64_t bytes) {
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 mask = lanes(n, d);
    const __m128i bytes16 = _mm512_castsi512_si128(_mm512_maskz_loadu_epi8((__mmask64)mask, codes + d));
    const __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16)), _mm512_set1_ps(scale));
    if (bytes == 4) _mm512_mask_storeu_ps((float *)out + d, mask, x);
    else _mm512_mask_storeu_epi16((uint16_t *)out + d, (__mmask32)mask, _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(x)));
  }
}

/* n values (bf16 or fp32, value_bytes) as int8 codes with one fp32 scale, max |x| / 127: cold_store._to_int8's
   codes, bit for bit (fp32 division, rounded to nearest even, clamped to +-127). Returns the scale. */
static inline float quantize(const void *values, int64_t n, int64_t value_bytes, int8_t *codes) {
  __m512 largest = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 16)
    largest = _mm512_max_ps(largest, _mm512_abs_ps(load_floats((const char *)values + d * value_bytes, value_bytes,
                                                               lanes(n, d))));
  const float top = _mm512_reduce_max_ps(largest), scale = (top > 1e-30f ? top : 1e-30f) / 127.0f;
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 mask = lanes(n, d);
    const __m512 x = load_floats((const char *)values + d * value_bytes, value_bytes, mask);
    __m512 code = _mm512_roundscale_ps(_mm512_div_ps(x, _mm512_set1_ps(scale)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    code = _mm512_min_ps(_mm512_max_ps(code, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    _mm512_mask_storeu_epi8(codes + d, (__mmask64)mask, _mm512_castsi128_si512(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(code))));
  }
  return scale;
}

/* n values (bf16: bytes 2, fp32: 4) as quantized slots hold them (h2ochat_kernels.quant.level_codes, 8 bits):
   offset = min, scale = max((max - min) / 255, tiny), codes = round((x - min) / scale) to nearest even, as
   uint8; each an IEEE fp32 op, as torch's, so the same codes and scales bit for bit. */
static inline void level_codes(const void *values, int64_t n, int64_t bytes, float tiny, uint8_t *codes,
                               float *scale_out, float *offset_out) {
  __m512 low = _mm512_set1_ps(INFINITY), high = _mm512_set1_ps(-INFINITY);
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 mask = lanes(n, d);
    const __m512 x = load_floats((const char *)values + d * bytes, bytes, mask);
    low = _mm512_mask_min_ps(low, mask, low, x);
    high = _mm512_mask_max_ps(high, mask, high, x);
  }
  const float offset = _mm512_reduce_min_ps(low), top = _mm512_reduce_max_ps(high);
  float scale = (top - offset) / 255.0f;
  if (!(scale >= tiny)) scale = tiny;
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 mask = lanes(n, d);
    const __m512 x = load_floats((const char *)values + d * bytes, bytes, mask);
    const __m512 code = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(x, _mm512_set1_ps(offset)), _mm512_set1_ps(scale)),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm512_mask_storeu_epi8(codes + d, (__mmask64)mask, _mm512_castsi128_si512(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(code))));
  }
  *scale_out = scale;
  *offset_out = offset;
}
