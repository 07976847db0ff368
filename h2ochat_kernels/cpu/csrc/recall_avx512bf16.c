/* The recall module for CPUs with AVX512-BF16: bf16 page scores by VDPBF16PS, 16-lane slot codes and rest sums.
   Built with -mavx512f -mavx512bw -mavx512bf16 (h2ochat_kernels/cpu/variants.py); loaded only where the CPU has
   avx512_bf16. Its sums are the portable variant's up to their order (tests/test_recall_native.py states the tolerance). */

#include <immintrin.h>

#define HAS_BF16_DOTS 1

#include "recall_common.h"
#include "page_scores_avx512bf16.h"
#include "page_scores_vectors.h"
#include "page_scores.h"
#include "frames_plan.h"
#include "slot_codes_avx512bf16.h"
#include "frames_fill.h"
#include "rest_avx512bf16.h"
#include "rest.h"
#include "recall_step.h"
#include "store_writes.h"
