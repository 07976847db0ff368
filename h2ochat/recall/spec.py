"""The recall tier of a whole cache (``RecallSpec``): one ``RecallTier`` per layer (``recall.tier``), made,
checked and summed up for the cache: statistics, the ``--json`` record, the bytes held."""

from __future__ import annotations

from .cold_store import resolved_cold_dtype
from .tier import RecallTier
from .tiered import RecallConfig, TierStats


class RecallSpec:
    """The recall tier of a whole cache: R recall columns per layer, one ``RecallTier`` each."""

    # a row left out of a decode step (a free row of a server) writes, evicts and stages nothing, and its
    # clock stands still (``row_cadence``): a step may leave rows out
    masks_inactive_rows = True
    # a prefix cache's layers step these tiers with ports of their first rows, the rows after them left out
    # (``RecallTier.batch``): a server's decode step runs the smallest bucket that holds its rows in use
    row_prefixes = True

    def __init__(self, config: RecallConfig, tier_type: type[RecallTier] = RecallTier):
        self.config, self.tier_type = config, tier_type
        self.columns = config.slots

    def make(self) -> RecallTier:
        return self.tier_type(self.config)

    def check(self, cache) -> None:
        if cache.mixed:
            raise ValueError("recall serves one policy for every row (not eval's mixed rows)")
        if cache.grows:
            raise ValueError("the full policy evicts nothing: recall needs an evicting policy")

    def compile_blocker(self, cache) -> str | None:
        """The compiled decode step takes recall on a CPU: the choice of pages and the flush of the
        staging page run before it (``RecallTier.reserve``), so the step itself only stages its victim
        and reads no host value. Not on an accelerator: there a recall step runs eagerly and chooses its
        pages in the step, as a CPU's (``RecallConfig.chooses_before``)."""
        if cache.initialized and cache.layers[0].device.type != "cpu":
            return "recall on an accelerator runs eagerly: its cold store is host memory (see recall/step.py)"
        if self.config.resolved_rest == "pages":  # (auto and prompt: the rest in prompt chunks only, which run eagerly)
            return "--recall-rest pages runs eagerly: each step reads its cold store's length (see recall/rest.py)"
        return None

    @staticmethod
    def _tiers(cache) -> list[RecallTier]:
        return [layer.tier for layer in cache.layers if layer.is_initialized]

    def selector(self, cache) -> str:
        """The selector the tiers run (``auto`` resolved once allocated)."""
        tiers = self._tiers(cache)
        return tiers[0].selector if tiers else self.config.selector

    def cold_dtype(self, cache) -> str:
        """The cold stores' format (``auto`` resolved by the model's dtype once allocated)."""
        tiers = self._tiers(cache)
        return tiers[0].cold.cold_dtype if tiers else resolved_cold_dtype(self.config.cold_dtype)

    def stats(self, cache) -> TierStats:
        """What the cold tier holds and did, summed over layers, rows and KV heads (reads the device)."""
        tiers = self._tiers(cache)
        pages = tokens = dropped = staged = 0
        for tier in tiers:
            first, end = tier.cold.held()
            pages += int((end - first).sum())
            tokens += int(tier.cold.held_tokens().sum())
            dropped += int(tier.cold.dropped().sum())
            staged += int(tier.staging.held().sum())
        return TierStats(
            cold_pages=pages, cold_tokens=tokens, dropped_tokens=dropped, host_bytes=self.cold_bytes(cache),
            digest_device_bytes=self.digest_bytes(cache),
            pages_copied=sum(int(tier.frames.copied.sum()) for tier in tiers),
            recalled_mass=sum(float(tier.recalled_mass.sum()) for tier in tiers),
            attended_mass=sum(float(tier.attended_mass.sum()) for tier in tiers),
            staged_tokens=staged, device_bytes_selector=self.digest_bytes(cache),
            device_bytes_staging=sum(tier.staging.nbytes() for tier in tiers),
            device_bytes_frames=sum(tier.bookkeeping_bytes() for tier in tiers),
            selector_host_bytes=sum(tier.digest.host_nbytes() for tier in tiers),
            pages_per_summary=max((tier.digest.pages_per_entry for tier in tiers), default=1),
            summary_cap=tiers[0].digest.cap if tiers else None,
            host_bytes_written=sum(tier.cold.written_nbytes() + tier.digest.host_nbytes() + tier.page_means.written_nbytes()
                                   for tier in tiers))

    def cold_bytes(self, cache) -> int:
        """Host bytes of the cold stores, of the token-level codes a two-stage selector keeps beside them and of
        the rest's page means."""
        return sum(tier.cold.nbytes() + tier.digest.host_nbytes() + tier.page_means.nbytes() for tier in self._tiers(cache))

    def host_bytes_per_token(self, cache) -> float:
        """Host bytes one evicted token of one row costs, over every layer and KV head (allocated cache)."""
        return sum(tier.host_bytes_per_token() for tier in self._tiers(cache))

    def digest_bytes(self, cache) -> int:
        """Device bytes of what scores the pages (the digests, or a two-stage selector's summaries)."""
        return sum(tier.digest.nbytes() for tier in self._tiers(cache))

    def record(self, cache) -> dict:
        """What the cold tier holds and did, for ``--json`` records: recall slots per layer (part of the
        device budget), the digests' device bytes, the cold stores' host bytes, pages copied in."""
        stats = self.stats(cache)
        config = self.config
        return {"recall_slots": config.slots, "page": config.page, "selector": self.selector(cache),
                "every": config.every, "cold_dtype": self.cold_dtype(cache), "cold_limit": config.cold_limit,
                "digest_device_bytes": stats.digest_device_bytes, "cold_host_bytes": stats.host_bytes,
                "cold_host_bytes_written": stats.host_bytes_written,
                "pages_copied": stats.pages_copied, "staged_tokens": stats.staged_tokens,
                "device_bytes_selector": stats.device_bytes_selector,
                "device_bytes_staging": stats.device_bytes_staging, "device_bytes_frames": stats.device_bytes_frames,
                "device_bytes": stats.device_bytes, "selector_host_bytes": stats.selector_host_bytes,
                "pages_per_summary": stats.pages_per_summary, "summary_cap": stats.summary_cap}
