/* The cold store's and the staging page's writes: a decode step's victims staged, evicted tokens appended,
   a staging page flushed. */

#pragma once

/* StagingPage.put: the victim in policy column slot[b, h] of each (sequence, head) copied into staging
   column count[b, h] (< P), then counted. sources/targets: [0] keys (D elements of key_bytes), [1] values
   (Dv of value_bytes), [2] token index, [3] positions (int64): the layer's policy columns and its staging
   columns; [4 ...] (extras of them): 4-byte values a slot (a quantized slot's scales and offsets). active
   [B] (bytes; NULL: every row): a row left out writes an empty entry (its victim with token index -1) and
   does not count it, as the torch route's put does. */
void h2ochat_stage(int64_t B, int64_t H, int64_t P, const int64_t *slot, int64_t *count, const strided_t *sources,
                   const strided_t *targets, int64_t D, int64_t key_bytes, int64_t Dv, int64_t value_bytes,
                   const uint8_t *active, int64_t extras) {
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = b * H + h, from = slot[row], to = count[row];
      const int in_step = !active || active[b];
      if (to >= P) continue; /* (never: the page is flushed before a step that could fill it past P) */
      memcpy(at(&targets[0], b, h, to, key_bytes), at(&sources[0], b, h, from, key_bytes), D * key_bytes);
      memcpy(at(&targets[1], b, h, to, value_bytes), at(&sources[1], b, h, from, value_bytes), Dv * value_bytes);
      *(int64_t *)at(&targets[2], b, h, to, 8) = in_step ? *(const int64_t *)at(&sources[2], b, h, from, 8) : -1;
      *(int64_t *)at(&targets[3], b, h, to, 8) = *(const int64_t *)at(&sources[3], b, h, from, 8);
      for (int64_t e = 4; e < 4 + extras; e++)
        *(uint32_t *)at(&targets[e], b, h, to, 4) = *(const uint32_t *)at(&sources[e], b, h, from, 4);
      count[row] = to + in_step;
    }
}

/* One entry e of (sequence b, head h) of ``in`` into store slot ``slot`` (see h2ochat_cold_append). */
static inline void store_entry(const strided_t *in, int64_t b, int64_t h, int64_t e, int64_t token,
                               const strided_t *store, int64_t slot, int64_t D, int64_t key_bytes,
                               int64_t store_key_bytes, int64_t Dv, int64_t value_bytes) {
  const int64_t position = *(const int64_t *)at(&in[3], b, h, e, 8);
  *(int32_t *)at(&store[2], b, h, slot, 4) = (int32_t)token;
  *(int32_t *)at(&store[3], b, h, slot, 4) = (int32_t)position;
  *(int32_t *)at(&store[4], b, h, slot, 4) = (int32_t)position;
  copy_floats(at(&store[0], b, h, slot, store_key_bytes), store_key_bytes, at(&in[0], b, h, e, key_bytes), key_bytes, D);
  const void *values = at(&in[1], b, h, e, value_bytes);
  if (!store[5].data) {
    memcpy(at(&store[1], b, h, slot, value_bytes), values, Dv * value_bytes);
    return;
  }
  *(float *)at(&store[5], b, h, slot, 4) = quantize(values, Dv, value_bytes, at(&store[1], b, h, slot, 1));
}

/* ColdStore.append for a store that never wraps, room reserved: each (sequence, head)'s entries e < E whose
   token index is >= 0 go to slots count, count + 1, ... in order (slots[b, h, e] out: the slot, or -1).
   in/store: [0] keys, [1] values, [2] token index (int64 in, int32 stored), [3] positions (likewise;
   stored as positions and as encoded, store[4]); store[5] value scales (data NULL: values copied as
   they are, value_bytes each; else int8 codes of bf16 (value_bytes 2) or fp32 (4) values with one fp32
   scale, max |x| / 127, as cold_store._to_int8 makes them). Keys are copied (D elements of key_bytes), into
   the store's store_key_bytes (fp32 keys rounded to bf16 for a store of bf16 keys). */
void h2ochat_cold_append(int64_t B, int64_t H, int64_t E, int64_t *count, int64_t capacity, const strided_t *in,
                         const strided_t *store, int64_t D, int64_t key_bytes, int64_t Dv, int64_t value_bytes,
                         int64_t store_key_bytes, int64_t *slots) {
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = b * H + h;
      for (int64_t e = 0; e < E; e++) {
        const int64_t token = *(const int64_t *)at(&in[2], b, h, e, 8);
        if (token < 0) {
          slots[row * E + e] = -1;
          continue;
        }
        const int64_t slot = count[row]++;
        slots[row * E + e] = slot;
        if (slot < capacity) /* (always: the caller reserved room) */
          store_entry(in, b, h, e, token, store, slot, D, key_bytes, store_key_bytes, Dv, value_bytes);
      }
    }
}

/* RecallTier.flush of the sequences marked in ``rows`` ([B] bytes; NULL: every one): each one's staging
   entries (``page``: the staging columns, laid out as h2ochat_cold_append's ``in``) appended to the store
   as h2ochat_cold_append appends them, then its staging columns emptied (token index and position -1) and
   its entry count staged[b, h] zeroed, as StagingPage.clear does. The other sequences are left as they are. */
void h2ochat_flush(int64_t B, int64_t H, int64_t E, const uint8_t *rows, int64_t *count, int64_t capacity,
                   const strided_t *page, const strided_t *store, int64_t D, int64_t key_bytes, int64_t Dv,
                   int64_t value_bytes, int64_t store_key_bytes, int64_t *staged) {
  for (int64_t b = 0; b < B; b++) {
    if (rows && !rows[b]) continue;
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = b * H + h;
      for (int64_t e = 0; e < E; e++) {
        int64_t *token_index = (int64_t *)at(&page[2], b, h, e, 8);
        const int64_t token = *token_index;
        if (token >= 0) {
          const int64_t slot = count[row]++;
          if (slot < capacity) /* (always: the caller reserved room) */
            store_entry(page, b, h, e, token, store, slot, D, key_bytes, store_key_bytes, Dv, value_bytes);
        }
        *token_index = -1;
        *(int64_t *)at(&page[3], b, h, e, 8) = -1;
      }
      staged[row] = 0;
    }
  }
}

