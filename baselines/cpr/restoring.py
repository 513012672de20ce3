"""Restoring a checkpoint: finding the chain to load (a cut, a sequence number or the newest complete one), checking
every table and dense tensor of it against this server, and writing base + deltas in order, with the exact loss
accounting's counters put back as the checkpoint recorded them.

Part of the checkpointing strategies (``baselines.cpr``): :class:`CheckpointRestoring` holds the methods, the state
they use lives on the strategy (:class:`baselines.cpr.strategy._CheckpointStrategy`).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from baselines.cpr.saving import spec_dict
from baselines.storage import (CheckpointCorrupt, CheckpointError, chain_of, latest_chain, load_checkpoint,
                               read_manifest, saved_by, scan)
from ecrec import errors

log = logging.getLogger("baselines.cpr")


def refusal(exc: CheckpointError) -> errors.EcrecError:
    """The error that answers a checkpoint that cannot be used: DATA_LOSS when corrupt, else FAILED_PRECONDITION."""
    cls = errors.DataLoss if isinstance(exc, CheckpointCorrupt) else errors.FailedPrecondition
    return cls(f"{type(exc).__name__}: {exc}")


class CheckpointRestoring:
    """Find, verify and apply a checkpoint (see the module docstring)."""

    def _find(self, index: int, cut: int | None, seq: int | None):
        entries, foreign = [], []  # a directory reused by a new job holds another cluster's checkpoints
        for e in scan(self.storage, index):
            (entries if not e.complete or saved_by(self.storage, e, self.host.cluster_id) else foreign).append(e)
        if foreign:
            log.warning("%s holds checkpoints of another cluster (%s%s): never restored here",
                        self.storage.describe(f"server-{index}"), ", ".join(e.dirname for e in foreign[-3:]),
                        f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        if cut is not None:
            for e in reversed(entries):
                if e.delta is None and e.complete and read_manifest(self.storage, e.dirname).get("cut") == cut:
                    return e, [], []
            raise CheckpointError(f"server {index} has no complete checkpoint of cut {cut} in "
                                  f"{self.storage.describe(f'server-{index}')}")
        if seq is not None:
            base = next((e for e in entries if e.seq == seq and e.delta is None), None)
            if base is None:
                raise CheckpointError(f"server {index} has no checkpoint seq {seq}")
            read_manifest(self.storage, base.dirname)  # raises if torn
            deltas = [e for e in entries if e.seq == seq and e.delta is not None and e.complete]
            return base, deltas, [e for e in entries if e.seq == seq and e.delta is not None and not e.complete]
        return chain_of(entries)

    def restore(self, cut: int | None = None, seq: int | None = None) -> dict:
        """Loads (and verifies) a checkpoint into this server's tables and dense tensors."""
        index = self._index()
        with self._lock:
            self._wait_pending()
            base, deltas, skipped = self._find(index, cut, seq)
            if skipped:
                names = [e.dirname for e in skipped]
                log.warning("skipping incomplete (torn) checkpoints %s", names)
                with self._stats_lock:
                    self._s["incomplete_skipped"] = names
            t0 = time.perf_counter()
            base, deltas, loaded, corrupt = self._load_chain(index, base, deltas, newest=cut is None and seq is None)
            if corrupt:
                with self._stats_lock:
                    self._s["corrupt_skipped"] = corrupt
            if base is None:
                self.needs_restore = False
                return {"seq": None, "deltas": [], "load_s": 0.0, "skipped": [e.dirname for e in skipped],
                        "corrupt": corrupt}
            with self.host.pushes_paused():
                self._apply(index, loaded)
            load_s = time.perf_counter() - t0
            manifest = loaded[0].manifest
            # a chain cut short (a corrupt delta) stays on disk: deltas numbered after it would be restored by no
            # later failure (the chain stops there again), so the next save is a full one
            self._base_seq = None if corrupt else base.seq
            self._next_seq = max((e.seq for e in scan(self.storage, index)), default=0) + 1
            self._next_delta.pop(base.seq, None)
            self._next_full_at = None
            self.needs_restore = False
            info = {
                "seq": base.seq, "cut": manifest.get("cut"), "step": manifest.get("step"),
                "deltas": [d.delta for d in deltas], "skipped": [e.dirname for e in skipped], "load_s": load_s,
                "corrupt": corrupt,
                "bytes": sum(x.bytes_read for x in loaded),
                "row_updates": {name: a.updates for name, a in self._acct.items()},
            }
            with self._stats_lock:
                self._s["loads"] += 1
                self._s["load_s_last"] = load_s
                self._s["load_bytes_last"] = info["bytes"]
                self._s["restored"] = info
            return info

    def _load_chain(self, index: int, base, deltas, newest: bool):
        """Reads and verifies ``base`` and its ``deltas``: ``(base, deltas, loaded, corrupt)``.  A checkpoint asked
        for (a cut, a sequence number) that is corrupt is refused (``CheckpointCorrupt``).  The newest one, which a
        replacement restores, is not worth an index that can never be replaced: a corrupt delta ends the chain
        before it, a corrupt base gives way to the next older complete one (none left: initial values), each named
        in ``corrupt`` and logged; the loss count stays exact (the counters come from what is applied)."""
        corrupt: list[str] = []
        while base is not None:
            try:
                loaded = [load_checkpoint(self.storage, base.dirname)]
            except CheckpointCorrupt as exc:
                if not newest:
                    raise
                log.error("%s; restoring the next older checkpoint instead", exc)
                corrupt.append(base.dirname)
                base, deltas, _ = latest_chain(self.storage, index, self.host.cluster_id, before=base.seq)
                continue
            kept = []
            for d in deltas:
                try:
                    loaded.append(load_checkpoint(self.storage, d.dirname))
                except CheckpointCorrupt as exc:
                    if not newest:
                        raise
                    log.error("%s; restoring without it and the deltas after it", exc)
                    corrupt.append(d.dirname)
                    break
                kept.append(d)
            return base, kept, loaded, corrupt
        return None, [], [], corrupt

    def _apply(self, index: int, loaded) -> None:
        """Checks every table of every checkpoint against this server, then writes base + deltas in order."""
        layout = self.host.layout
        plans = {}  # table -> [(slots, payload, counts, row_updates)] base first
        for n, ck in enumerate(loaded):
            for name, t in ck.tables.items():
                shard = dict(self._tables()).get(name)
                if shard is None:
                    raise CheckpointError(f"{self.storage.describe(ck.dirname)} holds table {name!r}, unknown on this server")
                if t.spec != spec_dict(shard.spec):
                    raise CheckpointError(f"{self.storage.describe(ck.dirname)}: table {name!r} was saved as {t.spec}, "
                                          f"the live table is {spec_dict(shard.spec)}")
                servers, slots = layout.locate(t.ids)
                if len(t.ids) and (servers != index).any():
                    raise CheckpointError(f"{self.storage.describe(ck.dirname)}: table {name!r} holds rows not owned by "
                                          f"server {index} (saved under another layout)")
                if n == 0 and len(t.ids) != len(shard.owned_ids):
                    raise CheckpointError(f"{self.storage.describe(ck.dirname)}: table {name!r} has {len(t.ids)} rows, "
                                          f"server {index} owns {len(shard.owned_ids)}")
                if n > 0 and name not in plans:
                    raise CheckpointError(f"{self.storage.describe(ck.dirname)}: delta of table {name!r} has no base")
                plans.setdefault(name, []).append((slots, t.payload, t.counts, t.row_updates))
        for d_name, floats in loaded[0].dense.items():
            d = dict(self._dense()).get(d_name)
            if d is None or d.nbytes != floats.nbytes:
                raise CheckpointError(f"{self.storage.describe(loaded[0].dirname)}: dense tensor {d_name!r} does not "
                                      "match this server's")
        self._restored_rows, self._restored_base = {}, {}
        for name, shard in self._tables():
            acct = self._account(shard)
            acct.reset_capture()
            if acct.reservoir is not None:
                acct.reset_sample()
            steps = plans.get(name)
            if steps is None:  # created after the checkpoint: back to its initial values
                shard.reset_to_initial()
                acct.updates = 0
                continue
            for i, (slots, payload, counts, row_updates) in enumerate(steps):
                shard.write_payload(slots, payload)
                if i == 0:
                    acct.updates = row_updates
                elif acct.since_full is not None and counts is not None:
                    acct.since_full[slots] = counts
                    acct.captured[slots] = counts
            if acct.since_full is not None:
                acct.updates += int(acct.since_full.sum())
                saved = np.flatnonzero(acct.since_full)
                self._restored_rows[name] = (acct.slot_to_id[saved], acct.since_full[saved].copy())
            self._restored_base[name] = int(steps[0][3])
        dense = dict(self._dense())
        for d_name, floats in loaded[0].dense.items():
            dense[d_name].write(np.ascontiguousarray(floats, dtype=np.float32).view(np.uint8).reshape(-1))
