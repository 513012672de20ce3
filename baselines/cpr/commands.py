"""The checkpointing strategies' commands (``StrategyCall``, JSON; listed in ``baselines.cpr``'s docstring): their
arguments checked, each answered by the saving, restoring or timer machinery, and ``stats``.

Part of the checkpointing strategies (``baselines.cpr``): :class:`CheckpointCommands` holds the handlers, the state
they read lives on the strategy (:class:`baselines.cpr.strategy._CheckpointStrategy`).
"""

from __future__ import annotations

import time

from baselines.cpr.restoring import refusal
from baselines.options import _float
from baselines.storage import CheckpointError, latest_chain, load_checkpoint, read_manifest, saved_by, scan
from ecrec import errors


class CheckpointCommands:
    """``call``'s handlers (see the module docstring)."""

    def call(self, command: str, args: dict) -> dict:
        handlers = {
            "save": self._cmd_save, "flush": self._cmd_flush, "list": self._cmd_list, "restore": self._cmd_restore,
            "probe_load": self._cmd_probe_load, "configure": self._cmd_configure, "timers": self._cmd_timers,
            "stats": lambda a: self.stats(), "restored_rows": self._cmd_restored_rows,
        }
        h = handlers.get(command)
        if h is None:
            raise ValueError(f"strategy {self.name!r} has no command {command!r}; commands: {sorted(handlers)}")
        try:
            return h(args)
        except CheckpointError as exc:
            raise refusal(exc) from None
        except (ConnectionError, TimeoutError) as exc:  # a remote store that did not answer: try again
            raise errors.Unavailable(f"{command}: the checkpoint storage {self.storage.url}: "
                                     f"{type(exc).__name__}: {exc}") from None
        except OSError as exc:  # the storage: a directory that is a file, no permission, a full disk
            raise errors.FailedPrecondition(f"{command}: the checkpoint storage {self.storage.url}: "
                                            f"{type(exc).__name__}: {exc}") from None

    @staticmethod
    def _known_args(command: str, args: dict, allowed: set) -> None:
        unknown = set(args) - allowed
        if unknown:
            raise ValueError(f"{command}: unknown arguments {sorted(unknown)}")

    @staticmethod
    def _opt_int(args: dict, key: str) -> int | None:
        v = args.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"argument {key!r} must be an integer, got {v!r}")
        return v

    def _cmd_save(self, args: dict) -> dict:
        self._known_args("save", args, {"kind", "cut", "step", "wait", "keep_cut"})
        return self.save(kind=args.get("kind", "full"), cut=self._opt_int(args, "cut"), step=self._opt_int(args, "step"),
                         wait=bool(args.get("wait", False)), keep_cut=self._opt_int(args, "keep_cut"))

    def _cmd_flush(self, args: dict) -> dict:
        with self._lock:
            waited = self._wait_pending()
        with self._stats_lock:
            return {"waited_s": waited, "last_committed_seq": self._s["last_committed_seq"],
                    "last_committed_cut": self._s["last_committed_cut"], "last_error": self._s["last_error"]}

    def _cmd_list(self, args: dict) -> dict:
        index = self._index()
        complete, incomplete, cuts, foreign = [], [], [], []
        for e in scan(self.storage, index):
            if not e.complete:
                incomplete.append(e.dirname)
                continue
            if not saved_by(self.storage, e, self.host.cluster_id):  # another cluster's: never restored, no cut of ours
                foreign.append(e.dirname)
                continue
            if e.delta is None:
                m = read_manifest(self.storage, e.dirname)
                complete.append({"seq": e.seq, "cut": m.get("cut"), "step": m.get("step")})
                if m.get("cut") is not None:
                    cuts.append(m["cut"])
            else:
                complete.append({"seq": e.seq, "delta": e.delta})
        return {"complete": complete, "incomplete": incomplete, "cuts": sorted(cuts), "foreign": foreign}

    def _cmd_restore(self, args: dict) -> dict:
        self._known_args("restore", args, {"cut", "seq"})
        return self.restore(cut=self._opt_int(args, "cut"), seq=self._opt_int(args, "seq"))

    def _cmd_probe_load(self, args: dict) -> dict:
        """Reads and verifies the newest checkpoint without applying it: measures o_load."""
        index = self._index()
        with self._lock:
            self._wait_pending()
        base, deltas, _ = latest_chain(self.storage, index, self.host.cluster_id)
        if base is None:
            return {"seq": None, "load_s": 0.0, "bytes": 0}
        t0 = time.perf_counter()
        nbytes = sum(load_checkpoint(self.storage, e.dirname).bytes_read for e in [base, *deltas])
        return {"seq": base.seq, "load_s": time.perf_counter() - t0, "bytes": nbytes}

    def _cmd_restored_rows(self, args: dict) -> dict:
        """What the last restore put back: per table the base checkpoint's update counter and the rows its deltas
        held, with the updates since the base each reflects (global ids and counts as lists)."""
        if args:
            raise ValueError(f"restored_rows: takes no arguments, got {sorted(args)}")
        with self._lock:
            return {"base_row_updates": dict(self._restored_base),
                    "rows": {name: {"ids": ids.tolist(), "counts": counts.tolist()}
                             for name, (ids, counts) in self._restored_rows.items()}}

    def _cmd_configure(self, args: dict) -> dict:
        self._known_args("configure", args, {"mode", "interval_s"})
        with self._lock:
            mode = args.get("mode", self.mode)
            if mode not in ("partial", "full"):
                raise ValueError(f"configure: mode must be 'partial' or 'full', got {mode!r}")
            if self.full_only and mode != "full":
                raise ValueError(f"strategy {self.name!r} only does full recovery")
            if "interval_s" in args:
                v = args["interval_s"]
                self._interval_override = None if v is None else _float("interval_s", v)
            self.mode = mode
            self._next_full_at = None
        return {"mode": self.mode, "interval_s": self.full_interval_s(), "partial_interval_s": self.partial_interval_s()}

    def _cmd_timers(self, args: dict) -> dict:
        """Pauses (``paused: true``) or resumes the timer saves without losing their phase; reports the timers.

        Pausing waits for the writes already started (``waited_s``), so their work ends before the caller
        goes on.
        Resuming moves the next full and partial save later by the time spent paused.
        """
        self._known_args("timers", args, {"paused"})
        paused = args.get("paused")
        if paused is not None and not isinstance(paused, bool):
            raise ValueError(f"timers: paused must be true or false, got {paused!r}")
        waited = 0.0
        with self._lock:
            now = time.monotonic()
            if paused is True and self._paused_at is None:
                self._paused_at = now
                waited = self._wait_pending()
            elif paused is False and self._paused_at is not None:
                shift = now - self._paused_at
                self._paused_at = None
                if self._next_full_at is not None:
                    self._next_full_at += shift
                if self._next_partial_at is not None:
                    self._next_partial_at += shift
            at = self._paused_at if self._paused_at is not None else time.monotonic()
            return {"paused": self._paused_at is not None, "waited_s": waited,
                    "next_full_in_s": None if self._next_full_at is None else self._next_full_at - at,
                    "next_partial_in_s": None if self._next_partial_at is None else self._next_partial_at - at,
                    "interval_s": self.full_interval_s(), "partial_interval_s": self.partial_interval_s()}

    def stats(self) -> dict:
        with self._stats_lock:
            out = dict(self._s)
        out.update(
            strategy=self.name, index=self.host.index, mode=self.mode, needs_restore=self.needs_restore,
            dir=self.storage.url, interval_s=self.full_interval_s(), partial_interval_s=self.partial_interval_s(),
            writing=sum(1 for f in list(self._pending) if not f.done()),
            row_updates={name: a.updates for name, a in self._acct.items()},
        )
        out["row_updates_total"] = sum(out["row_updates"].values())
        out["redundancy_bytes"] = sum(a.nbytes for a in list(self._acct.values()))  # the mechanism's memory only
        out["accounting_bytes"] = sum(a.accounting_nbytes for a in list(self._acct.values()))
        if self.variant == "ssu":
            out["ssu_sample_cap"] = self.opts.ssu_sample
            out["ssu_sample_max"] = max((a.res_max for a in self._acct.values()), default=0)
        if self.variant == "mfu":
            out["mfu_fraction"] = self.opts.mfu_fraction
        return out
