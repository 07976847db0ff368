/* The loaded frames' pages from the cold store into the recall slots (float slots, or 8-bit codes). */

#pragma once


/* fill_recall_slots for a plan read on the host: each loaded frame f of (b, h) takes page frame_page of the
   cold store, slot by slot (an absent slot: zeros, token index and position -1). Float slots are of
   value_bytes (2: bf16, 4: fp32): keys are copied from the store's key_bytes (bf16 keys widened for fp32
   slots); values too (value_scale NULL) or int8 codes times the token's fp32 scale. Store token indices and
   positions are int32, the slots' int64. ring: the store's frames (0: it never wraps). scales (NULL: float
   slots): the slots are 8-bit codes (D and Dv bytes) with [0] key_scale, [1] key_offset, [2] value_scale,
   [3] value_offset (fp32) beside them; key_bytes is then the store's keys', value_bytes the floats values are
   read or scaled to, and each slot's keys and values as page_tokens gives them (absent: zeros) are encoded by
   level_codes, as slot_format.encode does. */
static void fill_row(int64_t b, int64_t h, int64_t F, int64_t P, const uint8_t *load, const int64_t *frame_page,
                     int64_t held, int64_t ring, const strided_t *store, const strided_t *slots, int64_t D,
                     int64_t key_bytes, int64_t Dv, int64_t value_bytes, const strided_t *scales, float tiny) {
  /* store/slots: [0] keys, [1] values, [2] token index, [3] positions; store [4]: value scales (data NULL: none) */
  const int64_t end = (held + P - 1) / P, first = ring && end > ring ? end - ring : 0;
  const int64_t key_item = scales ? 1 : value_bytes, value_item = scales ? 1 : value_bytes;
  uint8_t scratch[scales ? (D > Dv ? D : Dv) * 4 : 1]; /* (zeros, or a slot's values as the store's dtype) */
  for (int64_t f = 0; f < F; f++) {
    if (!load[f]) continue;
    const int64_t page = frame_page[f];
    for (int64_t i = 0; i < P; i++) {
      const int64_t slot = page * P + i, column = f * P + i;
      const int present = page >= 0 && slot < held && page >= first;
      const int64_t source = ring ? slot % (ring * P) : slot;
      void *key = at(&slots[0], b, h, column, key_item), *value = at(&slots[1], b, h, column, value_item);
      int64_t *token = at(&slots[2], b, h, column, 8), *position = at(&slots[3], b, h, column, 8);
      if (scales) {
        const void *keys = scratch, *values = scratch;
        if (present) {
          keys = at(&store[0], b, h, source, key_bytes);
          values = at(&store[1], b, h, source, store[4].data ? 1 : value_bytes);
          *token = *(const int32_t *)at(&store[2], b, h, source, 4);
          *position = *(const int32_t *)at(&store[3], b, h, source, 4);
        } else {
          memset(scratch, 0, sizeof scratch);
          *token = *position = -1;
        }
        level_codes(keys, D, key_bytes, tiny, key, at(&scales[0], b, h, column, 4), at(&scales[1], b, h, column, 4));
        if (present && store[4].data) {
          store_scaled(values, *(const float *)at(&store[4], b, h, source, 4), Dv, scratch, value_bytes);
          values = scratch;
        }
        level_codes(values, Dv, value_bytes, tiny, value, at(&scales[2], b, h, column, 4),
                    at(&scales[3], b, h, column, 4));
        continue;
      }
      if (!present) {
        memset(key, 0, D * value_bytes);
        memset(value, 0, Dv * value_bytes);
        *token = *position = -1;
        continue;
      }
      copy_floats(key, value_bytes, at(&store[0], b, h, source, key_bytes), key_bytes, D);
      *token = *(const int32_t *)at(&store[2], b, h, source, 4);
      *position = *(const int32_t *)at(&store[3], b, h, source, 4);
      if (!store[4].data) {
        memcpy(value, at(&store[1], b, h, source, value_bytes), Dv * value_bytes);
        continue;
      }
      store_scaled(at(&store[1], b, h, source, 1), *(const float *)at(&store[4], b, h, source, 4), Dv, value,
                   value_bytes);
    }
  }
}

void h2ochat_fill_frames(int64_t B, int64_t H, int64_t F, int64_t P, const uint8_t *load, const int64_t *frame_page,
                         const int64_t *count, int64_t ring, const strided_t *store, const strided_t *slots,
                         int64_t D, int64_t key_bytes, int64_t Dv, int64_t value_bytes, const strided_t *scales,
                         float tiny) {
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = b * H + h;
      fill_row(b, h, F, P, load + row * F, frame_page + row * F, count[row], ring, store, slots, D, key_bytes, Dv,
               value_bytes, scales, tiny);
    }
}

/* ---- The rest of the cold pages (recall/rest.py's rest_column from the q.k the choice computed) ---- */

