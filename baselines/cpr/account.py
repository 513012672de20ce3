"""One table's counters on a checkpointing server: the row updates its state reflects, the per-row counts of the
exact loss accounting, MFU's access counters and SSU's reservoir sample (see ``baselines.cpr``)."""

from __future__ import annotations

import numpy as np


class TableAccount:
    """Counters of one table on this server (mutated under the table's lock)."""

    def __init__(self, shard, variant: str | None, sample_cap: int):
        n = shard.num_slots
        self.updates = 0  # row updates the in-memory state reflects
        self.slot_to_id = np.full(n, -1, dtype=np.int64)
        self.slot_to_id[shard.owned_slots] = shard.owned_ids
        self.since_full = np.zeros(n, dtype=np.int64) if variant else None  # updates since the base snapshot
        self.captured = np.zeros(n, dtype=np.int64) if variant else None  # since_full when the row was last saved
        self.freq = np.zeros(n, dtype=np.int64) if variant == "mfu" else None  # MFU access counters
        self.cap = sample_cap if variant == "ssu" else 0
        self.reservoir = np.zeros(self.cap, dtype=np.int64) if variant == "ssu" else None
        self.res_size = 0
        self.res_seen = 0
        self.res_max = 0

    @property
    def nbytes(self) -> int:
        """Memory the strategy's mechanism needs: MFU's counter per row, SSU's sample (the id map duplicates the
        shard's own, and ``since_full``/``captured`` serve the exact loss accounting, not the strategy)."""
        return int(sum(a.nbytes for a in (self.freq, self.reservoir) if a is not None))

    @property
    def accounting_nbytes(self) -> int:
        """Memory of the instrumentation: the id map and the per-row counts of the exact loss accounting."""
        return int(sum(a.nbytes for a in (self.slot_to_id, self.since_full, self.captured) if a is not None))

    def reset_capture(self) -> None:
        if self.since_full is not None:
            self.since_full.fill(0)
            self.captured.fill(0)

    def reset_sample(self) -> None:
        self.res_size = 0
        self.res_seen = 0

    def sample(self, slots: np.ndarray, rng: np.random.Generator) -> None:
        """Algorithm R over update events: every event seen since the reset is kept with equal probability."""
        cap = self.cap
        take = min(cap - self.res_size, len(slots))
        if take > 0:
            self.reservoir[self.res_size:self.res_size + take] = slots[:take]
            self.res_size += take
            self.res_seen += take
        rest = slots[take:]
        if rest.size:
            # event t (0-based, over all events since the reset) replaces entry j ~ U[0, t] when j < cap
            t = self.res_seen + np.arange(rest.size, dtype=np.int64)
            j = rng.integers(0, t + 1)
            keep = j < cap
            self.reservoir[j[keep]] = rest[keep]
            self.res_seen += rest.size
        self.res_max = max(self.res_max, self.res_size)
