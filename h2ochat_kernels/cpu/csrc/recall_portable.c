/* The recall module for every other CPU: page scores by vectors of 8 floats, slot codes and rest sums element by
   element or by vectors of 8. Built twice (h2ochat_kernels/cpu/variants.py): "avx2" with -mavx2 -mfma, and
   "generic" with the compiler's baseline, for CPUs without AVX2. */

#define HAS_BF16_DOTS 0

#include "recall_common.h"
#include "page_scores_vectors.h"

/* No VDPBF16PS here: page_scores.h never takes its bf16 route (bf16_route is 0), so this is never called. */
static inline void raise_page_scores(const uint16_t *q, int64_t M, int64_t D, const uint16_t *keys, int64_t key_t,
                                     const uint8_t *valid, int64_t filled, int64_t page, float *scores, float *dots,
                                     int64_t dot_stride) {
  (void)q, (void)M, (void)D, (void)keys, (void)key_t, (void)valid, (void)filled, (void)page, (void)scores,
      (void)dots, (void)dot_stride;
}

#include "page_scores.h"
#include "frames_plan.h"
#include "slot_codes_portable.h"
#include "frames_fill.h"
#include "rest_portable.h"
#include "rest.h"
#include "recall_step.h"
#include "store_writes.h"
