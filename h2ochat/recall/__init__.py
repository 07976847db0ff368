"""Recall: evicted tokens kept in a cold tier and brought back into a few reserved device slots.

The device keeps its fixed slots per (layer, sequence, KV head); R of them are recall slots. A token
the policy evicts goes to the cold store (host memory) in pages of P tokens; a small digest of every
page stays on the device, and each step the current queries score the pages through the digest
(``selectors``) and the best ones are copied into the recall slots (``step``).

Modules: ``tier`` (the tier of each cache layer: ``RecallTier``, and ``RecallSpec`` for a cache),
``tiered`` (its settings and figures: ``RecallConfig``, ``recall_slots``, ``TierStats``),
``selectors`` (page digests and their scores: exact, Quest bounds, quantised keys, ...),
``digests`` (the device digest of the cold keys), ``two_stage`` (bounded page summaries beside
the token codes), ``cold_store`` (the host tier), ``layout`` (where appended tokens land, fixed-shape writes, growth), ``step`` (top pages into the recall slots, with
an LRU), ``masked`` (the slow reference: a full cache whose attention mask admits hot + recalled
tokens, re-numbering the slow way past the position limit).
"""
