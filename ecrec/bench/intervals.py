"""Checkpoint intervals the overhead models choose for a ``compare`` run, and CPR's variants at one PLS.

- ``full``: Young/Daly's optimum (``baselines.overhead.optimal_full_interval``) from the measured
  save stall and the MTBF, turned into steps with the failure-free step time (the benchmark's
  clock runs while other strategies are timed, so the driver counts steps, not seconds).
- ``cpr``: the interval of a target PLS, ``2 * PLS * servers * MTBF`` (``interval_for_pls``).
- ``cpr-mfu`` / ``cpr-ssu`` at **equal PLS**: their partial saves (``r`` per full interval) keep the
  hot rows fresher, so the same PLS allows a longer full interval.  How much longer is measured,
  not assumed: :func:`mean_unsaved_updates` replays the run's own row updates of one shard (the
  same batches the worker will push) through each save policy and counts, at every step boundary,
  the updates no checkpoint holds yet: what a failure there would lose.  A variant's interval
  ``T`` is the fixed point of ``T = T_cpr / ratio(T)``, where ``ratio(T)`` is its mean of unsaved
  updates over plain ``cpr``'s at the same interval; then both lose the same expected number of
  updates per failure, i.e. reach the same PLS.

The replay follows ``baselines.cpr``: MFU keeps a counter per row since the server started and a
partial save writes the ``mfu_fraction`` most updated rows of each table that changed since they
were saved; SSU keeps a uniform sample of at most ``ssu_sample`` update events per table since the
last save (full or partial) and a partial save writes the sampled rows.  Every push counts once per
row it updates (the server coalesces duplicate ids); with ``weighted=True`` an update counts the
samples of the batch that looked its row up (CPR's PLS is a portion of lost *samples*: a hot row's
update carries more of them, which the row-update count understates).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from baselines import overhead

POLICIES = ("cpr", "cpr-mfu", "cpr-ssu")


def full_interval_steps(o_save_s: float, mtbf_s: float, step_s: float, formula: str = "daly",
                        persist_s: float = 0.0) -> tuple[int, float]:
    """``(steps, seconds)`` of full recovery's optimal interval, in steps of ``step_s`` (at least 1), never below
    the measured persist time ``persist_s``."""
    if not (step_s and step_s > 0 and math.isfinite(step_s)):
        raise ValueError(f"step_s must be finite and > 0, got {step_s!r}")
    seconds = overhead.optimal_full_interval(o_save_s, mtbf_s, formula, persist_s)
    steps = max(1, int(round(seconds / step_s)), int(math.ceil(persist_s / step_s - 1e-9)))  # never below the persist
    return steps, seconds


@dataclass(frozen=True)
class ShardUpdates:
    """One server's row updates step by step; a table's slots are numbered after the previous tables'."""

    steps: tuple[np.ndarray, ...]  # per step: the (unique) slots updated
    table_offsets: tuple[int, ...]  # table t has slots [offsets[t], offsets[t + 1])
    owned_rows: tuple[int, ...]  # real rows per table on this server (the rest of its slots is padding)
    samples: tuple[np.ndarray, ...] | None = None  # per step, per slot updated: the lookups of its row

    def __post_init__(self):
        if len(self.table_offsets) != len(self.owned_rows) + 1:
            raise ValueError("table_offsets needs one entry more than owned_rows")
        if not self.steps:
            raise ValueError("no steps of updates")
        if self.samples is not None and [len(x) for x in self.samples] != [len(x) for x in self.steps]:
            raise ValueError("samples needs one count per slot updated, step by step")

    @property
    def num_slots(self) -> int:
        return int(self.table_offsets[-1])


def shard_updates(step_ids: list[list[np.ndarray]], table_rows: list[int], layout, server: int) -> ShardUpdates:
    """The updates ``server`` receives when every step ``s`` pushes rows ``step_ids[s][t]`` of table ``t``."""
    offsets, owned = [0], []
    for rows in table_rows:
        where, _ = layout.locate(np.arange(rows, dtype=np.int64))
        owned.append(int((where == server).sum()))
        offsets.append(offsets[-1] + layout.data_slots_per_server(rows))
    steps, samples = [], []
    for ids_by_table in step_ids:
        if len(ids_by_table) != len(table_rows):
            raise ValueError(f"a step has ids of {len(ids_by_table)} tables, the model has {len(table_rows)}")
        parts, counts = [], []
        for t, ids in enumerate(ids_by_table):
            ids, n = np.unique(np.asarray(ids, dtype=np.int64), return_counts=True)
            if ids.size and (ids.min() < 0 or ids.max() >= table_rows[t]):
                raise ValueError(f"table {t}: ids outside [0, {table_rows[t]})")
            where, slots = layout.locate(ids)
            parts.append(slots[where == server] + offsets[t])
            counts.append(n[where == server])
        steps.append(np.concatenate(parts) if parts else np.empty(0, dtype=np.int64))
        samples.append(np.concatenate(counts) if counts else np.empty(0, dtype=np.int64))
    return ShardUpdates(tuple(steps), tuple(offsets), tuple(owned), tuple(samples))


def mean_unsaved_updates(updates: ShardUpdates, interval_steps: float, policy: str, partials_per_interval: int = 4,
                         mfu_fraction: float = 0.05, ssu_sample: int = 1024, seed: int = 0,
                         min_intervals: int = 8, weighted: bool = False) -> float:
    """Mean, over step boundaries, of the shard's row updates that no checkpoint holds (see the module docstring).

    Full saves every ``interval_steps`` steps (the first at step 0); with ``cpr-mfu``/``cpr-ssu`` a partial
    save at every ``interval_steps / partials_per_interval`` in between.  The steps are replayed in a cycle
    for at least ``min_intervals`` full intervals.  ``weighted``: each update counts its row's lookups in
    the batch (``ShardUpdates.samples``): the sample-weighted PLS.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not (interval_steps and interval_steps > 0 and math.isfinite(interval_steps)):
        raise ValueError(f"interval_steps must be finite and > 0, got {interval_steps!r}")
    if isinstance(partials_per_interval, bool) or not isinstance(partials_per_interval, int) or partials_per_interval < 1:
        raise ValueError(f"partials_per_interval must be an integer >= 1, got {partials_per_interval!r}")
    if not 0.0 < mfu_fraction <= 1.0:
        raise ValueError(f"mfu_fraction must be in (0, 1], got {mfu_fraction}")
    if ssu_sample < 1:
        raise ValueError(f"ssu_sample must be >= 1, got {ssu_sample}")
    if weighted and updates.samples is None:
        raise ValueError("a sample-weighted replay needs the updates' sample counts (shard_updates gives them)")
    rng = np.random.default_rng(seed)
    unsaved = np.zeros(updates.num_slots, dtype=np.int64)  # per row: updates since it was last saved
    freq = np.zeros(updates.num_slots, dtype=np.int64) if policy == "cpr-mfu" else None
    events: list[np.ndarray] = []  # cpr-ssu: update events since the last save
    offsets = updates.table_offsets
    partial_steps = interval_steps / partials_per_interval if policy != "cpr" else None
    total_steps = max(len(updates.steps), int(math.ceil(min_intervals * interval_steps)))
    unsaved_total = 0
    acc = 0.0
    fulls = partials = 0
    for b in range(1, total_steps + 1):
        slots = updates.steps[(b - 1) % len(updates.steps)]
        if weighted:
            w = updates.samples[(b - 1) % len(updates.steps)]
            unsaved[slots] += w
            unsaved_total += int(w.sum())
        else:
            unsaved[slots] += 1
            unsaved_total += int(slots.size)
        if freq is not None:
            freq[slots] += 1
        if policy == "cpr-ssu":
            events.append(slots)
        if int(b // interval_steps) > fulls:  # a full save at this boundary
            fulls = int(b // interval_steps)
            partials = int(b // partial_steps) if partial_steps else 0
            unsaved.fill(0)
            unsaved_total = 0
            events.clear()
        elif partial_steps and int(b // partial_steps) > partials:
            partials = int(b // partial_steps)
            saved = _mfu_rows(freq, unsaved, updates, mfu_fraction) if policy == "cpr-mfu" else \
                _ssu_rows(events, offsets, ssu_sample, rng)
            if saved.size:
                saved = saved[unsaved[saved] > 0]
                unsaved_total -= int(unsaved[saved].sum())
                unsaved[saved] = 0
            events.clear()
        acc += unsaved_total
    return acc / total_steps


def _mfu_rows(freq: np.ndarray, unsaved: np.ndarray, updates: ShardUpdates, fraction: float) -> np.ndarray:
    chosen = []
    for t, owned in enumerate(updates.owned_rows):
        lo, hi = updates.table_offsets[t], updates.table_offsets[t + 1]
        f = freq[lo:hi]
        hot = np.flatnonzero(f > 0)
        k = max(1, math.ceil(fraction * owned))
        if hot.size > k:
            hot = hot[np.argpartition(-f[hot], k - 1)[:k]]
        chosen.append(hot + lo)
    return np.concatenate(chosen) if chosen else np.empty(0, dtype=np.int64)


def _ssu_rows(events: list[np.ndarray], offsets: tuple[int, ...], cap: int, rng: np.random.Generator) -> np.ndarray:
    if not events:
        return np.empty(0, dtype=np.int64)
    seen = np.concatenate(events)
    chosen = []
    for t in range(len(offsets) - 1):
        table = seen[(seen >= offsets[t]) & (seen < offsets[t + 1])]
        if table.size > cap:
            table = rng.choice(table, size=cap, replace=False)  # what Algorithm R leaves: a uniform sample
        chosen.append(np.unique(table))
    return np.concatenate(chosen)


@dataclass(frozen=True)
class TunedInterval:
    """A ``cpr*`` strategy's intervals for a target PLS and why."""

    strategy: str
    interval_s: float  # between full saves
    partial_interval_s: float | None  # between partial saves (MFU/SSU)
    lost_ratio: float  # its mean unsaved updates over plain cpr's at the same interval (1 for cpr)
    expected_pls: float  # modelled: lost_ratio * interval / (2 * servers * mtbf)
    pls_basis: str = "updates"  # what the replay counted: row updates, or samples (updates weighed by lookups)

    def to_dict(self) -> dict:
        return asdict(self)


def equal_pls_intervals(target_pls: float, servers: int, mtbf_s: float, step_s: float, updates: ShardUpdates | None,
                        strategies: list[str], partials_per_interval: int = 4, mfu_fraction: float = 0.05,
                        ssu_sample: int = 1024, seed: int = 0, iterations: int = 4,
                        weighted: bool = False) -> dict[str, TunedInterval]:
    """Intervals at which each of ``strategies`` (cpr, cpr-mfu, cpr-ssu) reaches ``target_pls``.

    ``cpr`` takes ``interval_for_pls``; a variant the fixed point ``T = T_cpr / ratio(T)`` (``iterations``
    rounds from ``T_cpr``), its ratio replayed on ``updates`` with steps of ``step_s`` seconds.
    """
    unknown = [s for s in strategies if s not in POLICIES]
    if unknown:
        raise ValueError(f"equal-PLS tuning covers {POLICIES}, not {unknown}")
    if not (step_s and step_s > 0):
        raise ValueError(f"step_s must be > 0, got {step_s!r}")
    t_cpr = overhead.interval_for_pls(target_pls, servers, mtbf_s)
    out = {}
    for name in strategies:
        if name == "cpr":
            out[name] = TunedInterval(name, t_cpr, None, 1.0, overhead.expected_pls(t_cpr, servers, mtbf_s),
                                      "samples" if weighted else "updates")
            continue
        if updates is None:
            raise ValueError(f"tuning {name} to a PLS needs the run's updates")
        t, ratio = t_cpr, 1.0
        for _ in range(iterations):
            n = t / step_s
            kw = dict(partials_per_interval=partials_per_interval, mfu_fraction=mfu_fraction, ssu_sample=ssu_sample,
                      seed=seed, weighted=weighted)
            plain = mean_unsaved_updates(updates, n, "cpr", **kw)
            ratio = mean_unsaved_updates(updates, n, name, **kw) / plain if plain > 0 else 1.0
            t = t_cpr / max(ratio, 1e-3)
        out[name] = TunedInterval(name, t, t / partials_per_interval, ratio,
                                  ratio * overhead.expected_pls(t, servers, mtbf_s), "samples" if weighted else "updates")
    return out


# --- the interval a compare run chooses after its warm steps -------------------------------------------------------
PARTIALS_PER_INTERVAL = 4  # cpr-mfu/ssu: partial saves every full interval / 4 (baselines.cpr's default)


def cpr_interval(cfg: dict) -> tuple[float, str]:
    """cpr*'s full interval in seconds and how it was chosen: given, or ``2 * PLS * servers * MTBF``."""
    if cfg.get("cpr_interval_s"):
        return float(cfg["cpr_interval_s"]), "given"
    return overhead.interval_for_pls(cfg["target_pls"], cfg["servers"], cfg["mtbf_s"]), "target PLS"


def warm_step_s(records: list[dict]) -> float:
    """The median step time of a worker's records, past the first third (the first calls' set-up)."""
    durations = [r["end"] - r["start"] for r in records[len(records) // 3:]]
    return float(np.median(durations))


def choose_interval(strategy: str, cfg: dict, records: list[dict], driver, tuning=None) -> dict:
    """The interval of a checkpointing run, chosen after its warm steps (``records``) on its running
    ``driver`` (a ``baselines.driver.CheckpointDriver``), and why.

    ``full`` (or a ``cpr*`` strategy whose plan picked full recovery): Daly's optimum from the measured save
    stall, never below the measured persist time, in steps (set on the driver); the returned dict then has
    ``interval_steps``.  ``cpr*``: the PLS interval (CPR's plan's when it chose), or with ``--equal-pls`` the
    one tuned to cpr's PLS (``tuning``: ``compare_running.equal_pls_for``), set on every server.
    """
    from baselines.options import VARIANTS

    variant, full_only = VARIANTS[strategy]
    step_s = warm_step_s(records)
    plan = {"plan": driver.plan.to_dict()} if driver.plan is not None else {}
    if full_only or driver.mode == "full":  # consistent cuts, driven by the worker every N steps
        if cfg["checkpoint_interval_steps"]:
            n = int(cfg["checkpoint_interval_steps"])
            if driver.interval_steps != n:  # a cpr* run whose plan picked full: saved by steps from now on
                driver.set_interval_steps(n)
            return {"strategy": strategy, "how": "given", "interval_steps": n, "interval_s": n * step_s,
                    "step_s": step_s, **plan}
        o_save, persist = driver.o_save_s, driver.o_persist_s
        n, seconds = full_interval_steps(o_save, cfg["mtbf_s"], step_s, "daly", persist)
        driver.set_interval_steps(n)
        return {"strategy": strategy, "how": "Daly", "formula": "daly", "o_save_s": o_save,
                "o_save_source": "measured stall", "o_persist_s": persist, "mtbf_s": cfg["mtbf_s"], "step_s": step_s,
                "interval_s": seconds, "interval_steps": n, **plan}
    t, how = cpr_interval(cfg)
    if driver.plan is not None:  # CPR's plan picked partial recovery (its interval never below the persist time)
        t, how = driver.plan.partial_interval_s, "target PLS"
    info = {"strategy": strategy, "how": how, "target_pls": cfg["target_pls"], "servers": cfg["servers"],
            "mtbf_s": cfg["mtbf_s"], "step_s": step_s, "interval_s": t,
            "partial_interval_s": t / PARTIALS_PER_INTERVAL if variant else None,
            "expected_pls": overhead.expected_pls(t, cfg["servers"], cfg["mtbf_s"]), "lost_ratio": 1.0,
            "o_persist_s": driver.o_persist_s, **plan}
    if tuning is not None and strategy in tuning:
        tuned = tuning[strategy]
        info.update(tuned.to_dict(), how=f"equal PLS ({how} for cpr)", step_s=step_s)
        if tuned.interval_s < driver.o_persist_s:  # never below the persist time, as every interval
            info.update(interval_s=driver.o_persist_s, partial_interval_s=driver.o_persist_s / PARTIALS_PER_INTERVAL,
                        raised_to_persist=True)
        replies = driver.configure(interval_s=info["interval_s"])  # a replacement gets it too, at once
        info["servers_interval_s"] = sorted({round(r["interval_s"], 9) for r in replies.values()})
        info["servers_partial_interval_s"] = sorted({round(r["partial_interval_s"], 9) for r in replies.values()
                                                     if r["partial_interval_s"] is not None})
    return info
