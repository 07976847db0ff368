"""Recall: evicted tokens kept in a cold tier and brought back into a few reserved device slots.

The device keeps its fixed slots per (layer, sequence, KV head); R of them are recall slots. A token
the policy evicts goes to the cold store (host memory) in pages of P tokens; a small digest of every
page stays on the device, and each step the current queries score the pages through the digest
(``selectors``) and the best ones are copied into the recall slots (``step``).

Modules: ``selectors`` (page digests and their scores: exact, Quest bounds, quantised keys, ...),
``cold_store`` (the host tier), ``step`` (top pages into the recall slots, with an LRU),
``masked`` (the slow reference: a full cache whose attention mask admits hot + recalled tokens).
"""
