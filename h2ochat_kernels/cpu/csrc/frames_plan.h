/* The recall frames' plan (RecallFrames.update in h2ochat/recall/step.py, op for op) for frames in host memory. */

#pragma once

/* RecallFrames.update for frames in host memory (contiguous int64 / bool rows, one per (sequence, head)):
   the same plan, op for op (step.py has the torch version and its reasons). wanted [R, k]; frame_page,
   last_used, complete [R, F]; clock, copied [R]; complete_pages [R] or NULL; load [R, F] out. */
static void frames_update_row(int64_t F, int64_t k, const int64_t *want, int64_t *page, int64_t *used,
                              int64_t *clock, int64_t *copied, uint8_t *done, const int64_t *complete_pages,
                              uint8_t *loads) {
  const int64_t now = ++*clock;
  uint8_t kept[F > 0 ? F : 1];
  int64_t order[F > 0 ? F : 1], target[k > 0 ? k : 1];
  for (int64_t f = 0; f < F; f++) {
    kept[f] = 0;
    for (int64_t j = 0; j < k; j++) kept[f] |= want[j] >= 0 && page[f] == want[j];
    loads[f] = 0;
  }
  /* free frames, least recently used first (stable: equal clocks in frame order), kept frames last */
  for (int64_t f = 0; f < F; f++) {
    int64_t at = f;
    while (at > 0) {
      const int64_t other = order[at - 1];
      const int big_f = kept[f], big_o = kept[other];
      if (big_o < big_f || (big_o == big_f && (big_f || used[other] <= used[f]))) break;
      order[at] = other;
      at--;
    }
    order[at] = f;
  }
  /* the j-th missing page (in wanted order) to the j-th free frame */
  int64_t missing = 0;
  for (int64_t j = 0; j < k; j++) {
    target[j] = -1;
    if (want[j] < 0) continue;
    int found = 0;
    for (int64_t f = 0; f < F; f++) found |= page[f] == want[j];
    if (!found && missing < F) target[j] = order[missing++];
  }
  for (int64_t j = 0; j < k; j++)
    if (target[j] >= 0) loads[target[j]] = 1;
  int64_t new_page[F > 0 ? F : 1];
  for (int64_t j = 0; j < k; j++)
    if (target[j] >= 0) new_page[target[j]] = want[j];
  for (int64_t f = 0; f < F; f++) {
    if (loads[f]) page[f] = new_page[f];
    if (kept[f] || loads[f]) used[f] = now;
    *copied += loads[f];
  }
  if (complete_pages)
    for (int64_t f = 0; f < F; f++) {
      loads[f] |= !done[f] && page[f] >= 0;
      if (loads[f]) done[f] = page[f] < *complete_pages;
    }
}

void h2ochat_frames_update(int64_t rows, int64_t F, int64_t k, const int64_t *wanted, int64_t *frame_page,
                           int64_t *last_used, int64_t *clock, int64_t *copied, uint8_t *complete,
                           const int64_t *complete_pages, uint8_t *load) {
  for (int64_t r = 0; r < rows; r++)
    frames_update_row(F, k, wanted + r * k, frame_page + r * F, last_used + r * F, clock + r, copied + r,
                      complete + r * F, complete_pages ? complete_pages + r : NULL, load + r * F);
}
