"""``ecrec-bench simulate``: CPR's checkpoint overhead model at production scale, fed with measured costs.

``ecrec-bench compare`` measures every strategy on a small local cluster, where a failure
happens once, on purpose.  What matters in production is the *expected* overhead of a job
on hundreds of servers that fail at random.  This command evaluates the overhead model of
``reference/CPR.md`` (the functions of ``baselines/overhead.py``) over growing clusters,
with the per-operation costs taken from a ``compare`` report (``--from-compare``) or,
without one, from defaults measured once on the development machine (printed as such).

Per cluster of ``N`` servers holding a ``--model-gb`` model (``shard = model / N``) whose
servers each fail every ``--mtbf-hours`` (``mtbf = per-server MTBF / N`` for the job):

``full``
    Daly's (or Young's) optimal interval and ``O_full = o_save/T + (o_load + o_res + T/2)/mtbf``.
``cpr``
    partial recovery at the interval of the target PLS (``T = 2 p N mtbf``) and
    ``O_partial = o_save/T + (o_load + o_res)/mtbf``; the modelled PLS and CPR's own
    choice (``plan_recovery``: partial or full) are reported beside it.
``cpr-mfu`` / ``cpr-ssu``
    ``cpr`` plus ``r - 1`` partial saves of a fraction ``f`` of the shard per interval that
    cover a fraction ``h`` of the row updates (:func:`hot_partial_overhead`): hot rows lose
    ``T/r``, so the same PLS allows a longer interval.
``ecrec``
    the steady parity-update overhead (a fraction, measured) plus, per failure, the
    reschedule and the part of the rebuild of one shard that training does not overlap:
    ``O = parity + (o_res + (1 - ratio) * shard / rebuild_rate) / mtbf`` (:func:`ecrec_overhead`).
``none``
    ``o_res / mtbf`` only: no time is spent, but every failure loses a shard's state.

One cost basis: every strategy is charged its *measured failure-free overhead* from the same
compare run.  ECRec's is a constant fraction (``parity_overhead``); a checkpointing strategy's is
turned into seconds per save (overhead x its interval, see :func:`save_cost_from_overhead`), so that
it scales with the interval the model picks: ``{full,cpr,mfu,ssu}_save_bytes_per_s``.  The bare
training stall of a save (``save_bytes_per_s``, the driver's measured ``o_save``) is shown beside it
as "stall only": it leaves out what the background writes take from training.

Costs scale with the shard: ``o_save = shard / save_rate`` (per server, servers saving in
parallel), ``o_load = shard / load_rate``; ``--storage-gbps``
caps the aggregate bandwidth of the checkpoint store (then a full save or a full rollback
takes at least ``model / storage``).  Every input carries its ``source``: ``measured``
(taken from the compare report), ``modelled`` (inferred from measured figures through an
assumption, e.g. all of ``full``'s slowdown put on its saves when the report lacks the
driver's save stall), ``default`` (built in; see :data:`DEFAULTS` for how each was
obtained) or ``given`` (``--set NAME=VALUE``, ``--target-pls``, ``--reschedule-s``).  Every
output figure is modelled.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass

from baselines import overhead

#: the strategies this model has a formula for (every one shipped; see ``simulate``), in report order
MODELLED = frozenset({"none", "full", "cpr", "cpr-mfu", "cpr-ssu", "ecrec"})


def _modelled_strategies() -> tuple[str, ...]:
    from ecrec.strategies import ordered

    return tuple(name for name in ordered() if name in MODELLED)


STRATEGIES = _modelled_strategies()
SOURCES = ("measured", "modelled", "default", "given")
GB = 1e9
MB = 1e6

# The compare trainer's tables use Adagrad: each embedding weight carries one accumulator float.
_COMPARE_FLOATS_PER_WEIGHT = 2


@dataclass
class Input:
    value: float
    unit: str
    source: str  # one of SOURCES
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


# Built-in costs: the inputs `inputs_from_compare` reads from ecrec/bench/results/compare-quick-run1.json
# (`ecrec-bench compare --preset quick --equal-pls`, 2026-12-01, on the development machine: 2 cores shared
# with other jobs, load average 30-48 during the run, so steps took ~0.1 s against ~0.01 s on an idle machine;
# 4 servers, 8 tables x 20,000 rows x dim 16, Adagrad: 5.12 MB of embedding state per shard; 3 kills per
# strategy).  Of the two runs beside the README, this is the one whose reference spread less (84 % against
# 258 %); the README shows what the other one's inputs give.  Regenerate with
# `ecrec-bench simulate --from-compare REPORT --json OUT` and copy the values.  Absolute rates are those of
# this Python prototype on a loaded 2-core machine, not of a production parameter server: pass
# --from-compare with a report from the machine you care about.
_RUN = "dev machine, compare-quick-run1.json"
DEFAULTS: dict[str, tuple[float, str, str]] = {
    "save_bytes_per_s": (38.1e6, "bytes/s per server",
                         f"{_RUN}: median driver o_save_s (training stall per save) of full/cpr* = 134.4 ms per 5.12 MB "
                         "shard (stall only)"),
    "full_save_bytes_per_s": (9.99e6, "bytes/s per server",
                              f"{_RUN}: full's failure-free overhead +54.9 % (within noise) x its interval 0.934 s = "
                              "512.6 ms per save"),
    "cpr_save_bytes_per_s": (8.07e6, "bytes/s per server",
                             f"{_RUN}: cpr's overhead +79.3 % x its interval 0.800 s = 634.8 ms per save"),
    "mfu_save_bytes_per_s": (6.43e6, "bytes/s per server",
                             f"{_RUN}: cpr-mfu's overhead +50.2 % (within noise) x its interval 1.662 s / 1.048 = "
                             "796.1 ms per save"),
    "ssu_save_bytes_per_s": (4.14e6, "bytes/s per server",
                             f"{_RUN}: cpr-ssu's overhead +37.9 % (within noise) x its interval 3.728 s / 1.144 = "
                             "1236.0 ms per save"),
    "load_bytes_per_s": (86.5e6, "bytes/s per server",
                         f"{_RUN}: median driver o_load_s (verified load of a shard) of full/cpr* = 59.2 ms per 5.12 MB"),
    "reschedule_s": (0.253, "s", f"{_RUN}: none's promotion_s (kill -> a local standby promoted); production "
                                 "schedulers take far longer, see --reschedule-s"),
    "parity_overhead": (0.293, "fraction", f"{_RUN}: ecrec's failure-free overhead, median of 5 paired rounds "
                                           "(95 % interval +3 % to +64 %)"),
    "rebuild_bytes_per_s": (6.14e6, "bytes/s per server", f"{_RUN}: ecrec stats, 40,000 rows (5.12 MB) rebuilt in "
                                                          "0.83 s"),
    "recovery_throughput_ratio": (0.35, "fraction", f"{_RUN}: ecrec's useful throughput while recovering, mean of 3 "
                                                    "failures (0.94 for the first; later ones waited seconds for "
                                                    "promotion)"),
    "target_pls": (0.01, "fraction", "CPR's accuracy bound on lost updates (a choice, not a measurement)"),
    "partial_saves_per_interval": (4.0, "saves", "r: cpr-mfu/ssu save hot rows every interval / r (cpr.py's default)"),
    "mfu_save_fraction": (0.0159, "fraction", f"f, {_RUN}: cpr-mfu stats, 385,199 rows in 605 partial saves of "
                                              "40,000-row shards"),
    "mfu_update_coverage": (0.691, "fraction", f"h, {_RUN} (modelled): cpr-mfu's equal-PLS replay of the run's "
                                               "updates leaves g = 0.481 of cpr's unsaved; h = (1 - g) / (1 - 1/r)"),
    "ssu_save_fraction": (0.048, "fraction", f"f, {_RUN}: cpr-ssu stats, 618,272 rows in 322 partial saves"),
    "ssu_update_coverage": (1.0, "fraction", f"h, {_RUN} (modelled): cpr-ssu's replay gives g = 0.215, below 1/r: "
                                             "h clamped to 1"),
}


# --- pure formulas (beside baselines/overhead.py's) -------------------------------------------------
def hot_partial_overhead(o_save: float, o_load: float, mtbf: float, n_emb: int, target_pls: float,
                         save_fraction: float, coverage: float, partial_per_interval: float = 4.0,
                         o_res: float = 0.0) -> tuple[float, float, float]:
    """CPR-MFU/SSU: partial recovery plus hot-row saves; returns ``(interval, overhead, pls)``.

    Between two full saves ``T`` apart, ``r - 1`` partial saves (every ``T / r``) each write a
    fraction ``f`` of the shard; the rows they write receive a fraction ``h`` of the updates,
    which therefore lose ``T / r`` instead of ``T`` on a failure::

        PLS = (h / r + 1 - h) * T / (2 N mtbf)          so   T = interval_for_pls(p, N, mtbf) / (h / r + 1 - h)
        O   = o_save * (1 + (r - 1) f) / T + (o_load * (1 + (r - 1) f / 2) + o_res) / mtbf

    (a restore reads the base and on average half the interval's deltas).  With ``r = 1``, or
    ``f = h = 0``, this is plain partial recovery (:func:`baselines.overhead.partial_overhead`).
    """
    f, h, r = float(save_fraction), float(coverage), float(partial_per_interval)
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"save_fraction must be in [0, 1], got {save_fraction}")
    if not 0.0 <= h <= 1.0:
        raise ValueError(f"coverage must be in [0, 1], got {coverage}")
    if not (math.isfinite(r) and r >= 1.0):
        raise ValueError(f"partial_per_interval must be >= 1, got {partial_per_interval}")
    g = h / r + 1.0 - h  # lost updates relative to plain partial recovery at the same interval
    t = overhead.interval_for_pls(target_pls, n_emb, mtbf) / g
    extra = (r - 1.0) * f
    o = overhead.partial_overhead(t, o_save * (1.0 + extra), o_load * (1.0 + extra / 2.0), mtbf, o_res)
    return t, o, g * overhead.expected_pls(t, n_emb, mtbf)


def ecrec_overhead(parity_fraction: float, o_res: float, rebuild_s: float, recovery_ratio: float,
                   mtbf: float) -> float:
    """ECRec: ``parity + (o_res + (1 - ratio) * rebuild_s) / mtbf`` (training goes on while rebuilding)."""
    if not 0.0 <= recovery_ratio <= 1.0:
        raise ValueError(f"recovery_ratio must be in [0, 1], got {recovery_ratio}")
    if parity_fraction < 0 or o_res < 0 or rebuild_s < 0:
        raise ValueError("parity_fraction, o_res and rebuild_s must be >= 0")
    return parity_fraction + (o_res + (1.0 - recovery_ratio) * rebuild_s) / _mtbf(mtbf)


def none_overhead(o_res: float, mtbf: float) -> float:
    """No fault tolerance: only the reschedule costs time (the failed shard's state is lost)."""
    return float(o_res) / _mtbf(mtbf)


def _mtbf(mtbf: float) -> float:
    mtbf = float(mtbf)
    if not (math.isfinite(mtbf) and mtbf > 0):
        raise ValueError(f"mtbf must be finite and > 0, got {mtbf}")
    return mtbf


#: checkpointing strategy -> the prefix of its ``*_save_bytes_per_s`` input (its per-save cost)
CHECKPOINT_KEYS = {"full": "full", "cpr": "cpr", "cpr-mfu": "mfu", "cpr-ssu": "ssu"}


# --- the model per cluster size ---------------------------------------------------------------------
def simulate_row(servers: int, mtbf_hours: float, model_bytes: float, inputs: dict[str, Input],
                 formula: str = "daly", storage_bytes_per_s: float | None = None) -> dict:
    """Expected overhead (fraction of failure-free training time) of every strategy on ``servers`` servers."""
    v = {name: inp.value for name, inp in inputs.items()}
    n = int(servers)
    mtbf = mtbf_hours * 3600.0 / n
    shard = model_bytes / n
    o_res = v["reschedule_s"]

    def capped(own_s: float, total_bytes: float) -> float:
        return max(own_s, total_bytes / storage_bytes_per_s) if storage_bytes_per_s else own_s

    o_stall = capped(shard / v["save_bytes_per_s"], model_bytes)  # every server saves at about the same time
    # one cost basis: each checkpointing strategy's save costs what its measured failure-free overhead says
    o_save = {name: capped(shard / v[f"{key}_save_bytes_per_s"], model_bytes) for name, key in CHECKPOINT_KEYS.items()}
    o_load_one = capped(shard / v["load_bytes_per_s"], shard)  # partial: only the failed shard reloads
    o_load_all = capped(shard / v["load_bytes_per_s"], model_bytes)  # full: every server rolls back
    p = v["target_pls"]
    out: dict = {}

    def full_at(o: float) -> tuple[float, float]:
        t = overhead.optimal_full_interval(o, mtbf, formula)
        return t, overhead.full_overhead(t, o, o_load_all, mtbf, o_res)

    t_full, o_full = full_at(o_save["full"])
    out["full"] = {"overhead": o_full, "overhead_stall_only": full_at(o_stall)[1],
                   "interval_s": t_full, "o_save_s": o_save["full"], "o_save_stall_s": o_stall, "o_load_s": o_load_all,
                   "pls": 0.0}

    t_part = overhead.interval_for_pls(p, n, mtbf)
    plan = overhead.plan_recovery(o_save["cpr"], o_load_one, mtbf, n, p, o_res, formula)
    out["cpr"] = {"overhead": overhead.partial_overhead(t_part, o_save["cpr"], o_load_one, mtbf, o_res),
                  "overhead_stall_only": overhead.partial_overhead(t_part, o_stall, o_load_one, mtbf, o_res),
                  "interval_s": t_part, "o_save_s": o_save["cpr"], "o_save_stall_s": o_stall, "o_load_s": o_load_one,
                  "pls": overhead.expected_pls(t_part, n, mtbf), "plan": plan.recovery,
                  "plan_overhead": min(plan.full_overhead, plan.partial_overhead)}
    for name, key in (("cpr-mfu", "mfu"), ("cpr-ssu", "ssu")):
        args = (o_load_one, mtbf, n, p, v[f"{key}_save_fraction"], v[f"{key}_update_coverage"],
                v["partial_saves_per_interval"], o_res)
        t, o, pls = hot_partial_overhead(o_save[name], *args)
        out[name] = {"overhead": o, "overhead_stall_only": hot_partial_overhead(o_stall, *args)[1], "interval_s": t,
                     "o_save_s": o_save[name], "o_save_stall_s": o_stall, "o_load_s": o_load_one, "pls": pls}

    rebuild_s = shard / v["rebuild_bytes_per_s"]
    out["ecrec"] = {"overhead": ecrec_overhead(v["parity_overhead"], o_res, rebuild_s, v["recovery_throughput_ratio"], mtbf),
                    "rebuild_s": rebuild_s, "pls": 0.0}
    out["none"] = {"overhead": none_overhead(o_res, mtbf), "pls": None,
                   "note": "every failure loses the failed shard's state"}
    return {"servers": n, "job_mtbf_s": mtbf, "shard_bytes": shard, "failures_per_day": 86400.0 / mtbf,
            "strategies": out}


# --- inputs ---------------------------------------------------------------------------------------------
def default_inputs() -> dict[str, Input]:
    return {name: Input(value, unit, "default", note) for name, (value, unit, note) in DEFAULTS.items()}


def _num(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _stats_sum(entry: dict, key: str) -> float | None:
    stats = entry.get("stats")
    if not isinstance(stats, dict):
        return None
    values = [_num(s.get(key)) for s in stats.values() if isinstance(s, dict)]
    values = [x for x in values if x is not None]
    return sum(values) if values else None


def compare_shard_bytes(config: dict) -> float | None:
    """Embedding-state bytes of one server in a compare run, from its config (tables x rows x dim, Adagrad)."""
    ds = config.get("dataset") if isinstance(config.get("dataset"), dict) else {}
    tables = _num(ds.get("tables")) or _num(config.get("tables"))
    rows = _num(ds.get("rows_per_table")) or _num(config.get("rows_per_table"))
    dim, servers = _num(config.get("embedding_dim")), _num(config.get("servers"))
    if not (tables and rows and dim and servers):
        return None
    return tables * rows * dim * 4.0 * _COMPARE_FLOATS_PER_WEIGHT / servers


def inputs_from_compare(report: dict) -> tuple[dict[str, Input], list[str]]:
    """The inputs a compare report measures, and notes on those it could not give.

    Uses the per-strategy fields ``summarize()`` writes; ``driver`` (the checkpoint driver's
    report: ``o_save_s``, ``o_load_s``) and ``stats`` (the servers' strategy stats) are used
    when a report carries them.  Shard bytes come from the report's config.
    """
    if not isinstance(report, dict) or not isinstance(report.get("strategies"), dict):
        raise ValueError("not a compare report: no 'strategies' object")
    cfg = report.get("config") or {}
    st = {k: v for k, v in report["strategies"].items() if isinstance(v, dict)}
    ref = report.get("reference") or {}
    shard = compare_shard_bytes(cfg)
    shard_note = f"{shard / MB:.2f} MB shard from the compare config" if shard else ""
    found: dict[str, Input] = {}
    missing: list[str] = []

    def get(strategy: str, key: str) -> float | None:
        return _num(st.get(strategy, {}).get(key))

    def driver(strategy: str, key: str) -> float | None:
        d = st.get(strategy, {}).get("driver")
        return _num(d.get(key)) if isinstance(d, dict) else None

    def driver_median(key: str) -> tuple[float | None, str]:
        named = [(s, driver(s, key)) for s in ("full", "cpr", "cpr-mfu", "cpr-ssu")]
        named = [(s, x) for s, x in named if x]
        if not named:
            return None, ""
        xs = sorted(x for _, x in named)
        return statistics.median(xs), f"median driver {key} of {', '.join(s for s, _ in named)}"

    # save: the driver's measured stall, else full's failure-free slowdown spread over its saves
    if shard:
        o_save, how = driver_median("o_save_s")
        source = "measured"
        if not o_save:
            ov, rate, interval = get("full", "overhead_vs_none"), get("full", "samples_per_s_failure_free"), \
                _num(cfg.get("checkpoint_interval_steps"))
            batch, base = _num(cfg.get("batch_size")), _num(ref.get("samples_per_s_failure_free"))
            if ov is not None and ov > 0 and rate and interval and batch:
                base = base or rate * (1.0 + ov)
                o_save = ov * interval * batch / base  # stall per save = slowdown x steps per save x step time
                how = f"full's slowdown all put on its saves: overhead_vs_none {ov:+.1%} x {interval:.0f} steps/save"
                source = "modelled"
        if o_save:
            found["save_bytes_per_s"] = Input(shard / o_save, "bytes/s per server", source,
                                              f"{how} = {o_save * 1e3:.1f} ms per save; {shard_note}")
        else:
            missing.append("save_bytes_per_s: no 'full' run with a positive save cost in the report")
    # one cost basis: every checkpointing strategy's save costs what its measured failure-free overhead says
    r = DEFAULTS["partial_saves_per_interval"][0]
    for name, key in CHECKPOINT_KEYS.items():
        row = st.get(name)
        if row is None:
            continue
        f = None
        if key in ("mfu", "ssu"):
            saved, saves = _stats_sum(row, "rows_saved_partial"), _stats_sum(row, "partial_saves")
            dim = _num(cfg.get("embedding_dim"))
            shard_rows = shard / (dim * 4.0 * _COMPARE_FLOATS_PER_WEIGHT) if shard and dim else None
            f = min(saved / saves / shard_rows, 1.0) if saved and saves and shard_rows else DEFAULTS[f"{key}_save_fraction"][0]
        cost, note = save_cost_from_overhead(row, r, f)
        if cost and shard:
            found[f"{key}_save_bytes_per_s"] = Input(shard / cost, "bytes/s per server", "measured",
                                                     f"{note}; {shard_note}")
        else:
            missing.append(f"{key}_save_bytes_per_s: {note or 'no shard size'}")
        interval = row.get("interval") if isinstance(row.get("interval"), dict) else {}
        g = _num(interval.get("lost_ratio"))
        if key in ("mfu", "ssu") and str(interval.get("how", "")).startswith("equal PLS") and g is not None and 0 < g <= 1:
            h = (1.0 - g) / (1.0 - 1.0 / r)
            clamp = f"; g below 1/r = {1 / r:.3f}, which this model cannot express: h clamped to 1" if h > 1 else ""
            found[f"{key}_update_coverage"] = Input(min(h, 1.0), "fraction", "modelled",
                                                    f"h = (1 - g) / (1 - 1/r) from {name}'s equal-PLS replay of the "
                                                    f"compare run's updates (unsaved-update ratio g = {g:.3f}){clamp}")
    # load: the driver's probe, else cpr's promotion beyond none's (the replacement loads while promoted)
    if shard:
        o_load, how = driver_median("o_load_s")
        source = "measured"
        if not o_load:
            p_cpr, p_none = get("cpr", "promotion_s"), get("none", "promotion_s")
            if p_cpr is not None and p_none is not None and p_cpr > p_none:
                o_load, how = p_cpr - p_none, "cpr's promotion beyond none's put on its load: promotion_s difference"
                source = "modelled"
        if o_load:
            found["load_bytes_per_s"] = Input(shard / o_load, "bytes/s per server", source,
                                              f"{how} = {o_load * 1e3:.1f} ms; {shard_note}")
        else:
            missing.append("load_bytes_per_s: no checkpoint load measured in the report")
    for s in ("none", "ecrec"):
        promo = get(s, "promotion_s")
        if promo is not None and promo > 0:
            found["reschedule_s"] = Input(promo, "s", "measured", f"{s}: kill -> standby promoted (promotion_s)")
            break
    else:
        missing.append("reschedule_s: no promotion_s of 'none' or 'ecrec'")
    ov = get("ecrec", "overhead_vs_none")
    if ov is not None:
        note = "ecrec: overhead_vs_none" + (f" ({ov:+.1%} measured, clamped to 0: noise)" if ov < 0 else "")
        found["parity_overhead"] = Input(max(ov, 0.0), "fraction", "measured", note)
    else:
        missing.append("parity_overhead: no ecrec overhead_vs_none")
    rows, secs = _stats_sum(st.get("ecrec", {}), "rows_rebuilt"), _stats_sum(st.get("ecrec", {}), "rebuild_s")
    dim = _num(cfg.get("embedding_dim"))
    if rows and secs and dim:
        found["rebuild_bytes_per_s"] = Input(rows * dim * 4.0 * _COMPARE_FLOATS_PER_WEIGHT / secs, "bytes/s per server",
                                             "measured", f"ecrec stats: {rows:.0f} rows rebuilt in {secs:.2f} s")
    else:
        red, promo = get("ecrec", "fully_redundant_s"), get("ecrec", "promotion_s") or 0.0
        if shard and red is not None and red > promo:
            found["rebuild_bytes_per_s"] = Input(shard / (red - promo), "bytes/s per server", "measured",
                                                 f"ecrec: fully_redundant_s {red:.2f} s - promotion_s {promo:.2f} s; "
                                                 f"{shard_note}")
        else:
            missing.append("rebuild_bytes_per_s: no ecrec fully_redundant_s in the report")
    ratio = get("ecrec", "throughput_during_recovery_ratio")
    if ratio is not None:
        clamped = min(max(ratio, 0.0), 1.0)
        note = "ecrec: throughput_during_recovery_ratio" + (f" ({ratio:.2f}, clamped)" if clamped != ratio else "")
        found["recovery_throughput_ratio"] = Input(clamped, "fraction", "measured", note)
    else:
        missing.append("recovery_throughput_ratio: no ecrec throughput_during_recovery_ratio")
    target = _num(cfg.get("target_pls"))
    if target and 0 < target < 1:
        found["target_pls"] = Input(target, "fraction", "given", "the compare run's target PLS (a choice)")
    # MFU/SSU: the saved fraction from the servers' stats.  Their update coverage is not inferred from the
    # report: one failure loses the updates since the last save, uniform over the save cycle, so the ratio of
    # two runs' PLS is mostly the luck of where each failure fell (set it with --set *_update_coverage=H).
    for name, key in (("cpr-mfu", "mfu"), ("cpr-ssu", "ssu")):
        if name not in st:
            continue
        saved, saves = _stats_sum(st[name], "rows_saved_partial"), _stats_sum(st[name], "partial_saves")
        shard_rows = shard / (dim * 4.0 * _COMPARE_FLOATS_PER_WEIGHT) if shard and dim else None
        if saved and saves and shard_rows:
            f = min(saved / saves / shard_rows, 1.0)
            found[f"{key}_save_fraction"] = Input(f, "fraction", "measured",
                                                  f"{name} stats: {saved:.0f} rows in {saves:.0f} partial saves")
        else:
            missing.append(f"{key}_save_fraction: no server stats of {name} in the report")
    if not shard:
        missing.append("shard bytes: the report's config lacks tables/rows_per_table/embedding_dim/servers")
    return found, missing


def save_cost_from_overhead(row: dict, partials_per_interval: float, save_fraction: float | None) -> tuple[float | None, str]:
    """Seconds per save that a checkpointing strategy's measured failure-free overhead stands for.

    ``overhead x interval``, the interval in seconds of its own training time (``full``: its steps x its
    median step; ``cpr*``: its timer's seconds), divided by ``1 + (r - 1) f`` for MFU/SSU (their partial
    saves, a fraction ``f`` of the shard each, ``r - 1`` per interval).  A save costs at least its
    measured stall: an overhead below that (noise) is replaced by the stall, and the note says so.
    """
    ov = _num(row.get("overhead_vs_none"))
    interval = row.get("interval") if isinstance(row.get("interval"), dict) else {}
    steps, step_s = _num(interval.get("interval_steps")), _num(row.get("median_step_s"))
    seconds = steps * step_s if steps and step_s else _num(interval.get("interval_s"))
    driver = row.get("driver") if isinstance(row.get("driver"), dict) else {}
    stall = _num(driver.get("o_save_s"))
    if ov is None or not seconds:
        return None, f"no overhead_vs_none and interval of {row.get('strategy', 'this strategy')} in the report"
    factor = 1.0 + (partials_per_interval - 1.0) * save_fraction if save_fraction is not None else 1.0
    cost = ov * seconds / factor
    spread = row.get("overhead_spread") if isinstance(row.get("overhead_spread"), dict) else {}
    noise = " (within noise)" if spread.get("within_noise") else ""
    note = (f"{row.get('strategy', '')}: overhead {ov:+.1%}{noise} x interval {seconds:.3f} s"
            + (f" / (1 + (r - 1) f = {factor:.3f})" if factor != 1.0 else "") + f" = {cost * 1e3:.1f} ms per save")
    if stall and cost < stall:
        return stall, note + f"; below its save stall, so the stall ({stall * 1e3:.1f} ms) is charged"
    if cost <= 0:
        return None, note + "; no positive cost and no stall measured"
    return cost, note


# --- command line ---------------------------------------------------------------------------------------
def parse_servers(text: str) -> list[int]:
    """``8..1024`` (the ends and the powers of two between) or ``8,16,100`` or ``64``."""
    text = text.strip()
    try:
        if ".." in text:
            lo_s, hi_s = text.split("..", 1)
            lo, hi = int(lo_s), int(hi_s)
            if lo < 1 or hi < lo:
                raise argparse.ArgumentTypeError(f"range {text!r}: need 1 <= start <= end")
            out = [lo]
            p = 1
            while p <= lo:
                p *= 2
            while p < hi:
                out.append(p)
                p *= 2
            if hi != lo:
                out.append(hi)
            return out
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a range START..END or a comma list of integers") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: server counts must be integers >= 1")
    return values


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be finite and > 0")
    return x


def _fraction(text: str) -> float:
    x = _positive_float(text)
    if x >= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1)")
    return x


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--servers", type=parse_servers, default=parse_servers("8..1024"),
                   help="cluster sizes: START..END (powers of two between) or a comma list (default 8..1024)")
    p.add_argument("--mtbf-hours", type=_positive_float, default=24.0,
                   help="MTBF of one server in hours; the job's is this / servers (default 24)")
    p.add_argument("--model-gb", type=_positive_float, default=100.0,
                   help="embedding state (weights + optimizer state) in GB, spread over the servers (default 100)")
    p.add_argument("--from-compare", metavar="JSON", help="take the measured costs from an `ecrec-bench compare --json` report")
    p.add_argument("--target-pls", type=_fraction, help="cpr*: target portion of lost updates (default 0.01)")
    p.add_argument("--reschedule-s", type=float, help="reschedule cost per failure in seconds (overrides the measured one)")
    p.add_argument("--storage-gbps", type=_positive_float,
                   help="aggregate bandwidth of the checkpoint store in GB/s (default: unlimited, servers in parallel)")
    p.add_argument("--set", metavar="NAME=VALUE", type=_setting, action="append",
                   help="override one input, e.g. mfu_save_fraction=0.05 or mfu_update_coverage=0.6 "
                        f"(repeatable; inputs: {', '.join(DEFAULTS)})")
    p.add_argument("--formula", choices=overhead.FORMULAS, default="daly", help="full recovery's optimal interval (default daly)")
    p.add_argument("--json", metavar="PATH", help="write config, inputs (with sources) and rows as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of expected overhead vs servers (log x)")


def check_input(name: str, value: float) -> float:
    """Raises ValueError when ``value`` is not a valid ``name`` input."""
    if name not in DEFAULTS:
        raise ValueError(f"unknown input {name!r}; inputs: {', '.join(DEFAULTS)}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {value}")
    if name.endswith("bytes_per_s") and x <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if name == "target_pls" and not 0 < x < 1:
        raise ValueError(f"target_pls must be in (0, 1), got {value}")
    if name == "partial_saves_per_interval" and x < 1:
        raise ValueError(f"partial_saves_per_interval must be >= 1, got {value}")
    if name.endswith(("_fraction", "_coverage", "_ratio")) and not 0 <= x <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return x


def _setting(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name.strip()}: {value!r} is not a number") from None
    try:
        return name.strip(), check_input(name.strip(), number)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def resolve_inputs(args) -> tuple[dict[str, Input], list[str]]:
    """Defaults, then what ``--from-compare`` measured, then the command line (source ``given``)."""
    inputs = default_inputs()
    notes: list[str] = []
    if args.from_compare:
        with open(args.from_compare) as f:
            report = json.load(f)
        found, notes = inputs_from_compare(report)
        inputs.update(found)
    given = list(args.set or [])
    if args.target_pls is not None:
        given.append(("target_pls", args.target_pls))
    if args.reschedule_s is not None:
        given.append(("reschedule_s", check_input("reschedule_s", args.reschedule_s)))
    for name, value in given:
        inputs[name] = Input(value, inputs[name].unit, "given", "command line")
    notes = [n for n in notes if n.split(":", 1)[0] not in {name for name, _ in given}]
    return inputs, notes


def _fmt_input(name: str, inp: Input) -> str:
    if inp.unit.startswith("bytes/s"):
        value = f"{inp.value / MB:,.1f} MB/s"
    elif inp.unit == "fraction":
        value = f"{inp.value:.4g}"
    else:
        value = f"{inp.value:.4g} {inp.unit}"
    return f"  {name:<27} {value:>14}  {inp.source:<8}  {inp.note}"


def _pct(fraction: float) -> str:
    x = 100.0 * fraction
    return f"{x:.3f}" if x == 0 or x >= 0.001 else f"{x:.1e}"


def print_report(config: dict, inputs: dict[str, Input], notes: list[str], rows: list[dict]) -> None:
    print("ecrec-bench simulate: expected overhead of each strategy (CPR's overhead model, reference/CPR.md)")
    storage = f", checkpoint store {config['storage_gbps']} GB/s" if config["storage_gbps"] else ""
    print(f"  model {config['model_gb']:g} GB over N servers, per-server MTBF {config['mtbf_hours']:g} h "
          f"(job MTBF = {config['mtbf_hours']:g} h / N), {config['formula']} interval for full{storage}")
    print(f"  costs: {config['from_compare'] or 'built-in defaults (measured once on the dev machine, see DEFAULTS)'}")
    print("\ninputs (source: measured = from the compare report, modelled = inferred from its figures through an "
          "assumption, default = built in, given = command line):")
    for name, inp in inputs.items():
        print(_fmt_input(name, inp))
    for n in notes:
        print(f"  (default used) {n}")
    print("\nexpected overhead, % of failure-free training time (all modelled):")
    head = ["servers", "job MTBF h"] + list(STRATEGIES) + ["cpr PLS", "CPR picks"]
    cells = [head]
    for r in rows:
        s = r["strategies"]
        cells.append([str(r["servers"]), f"{r['job_mtbf_s'] / 3600:.3g}"]
                     + [_pct(s[name]["overhead"]) for name in STRATEGIES]
                     + [f"{s['cpr']['pls']:.4f}", s["cpr"]["plan"]])
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print("\ncheckpointing charged only its training stall per save (o_save = the driver's stall; the table above "
          "charges each strategy its measured failure-free overhead per save):")
    names = [n for n in CHECKPOINT_KEYS if n in STRATEGIES]
    cells = [["servers"] + [f"{n} (stall)" for n in names]]
    for r in rows:
        cells.append([str(r["servers"])] + [_pct(r["strategies"][n]["overhead_stall_only"]) for n in names])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    worst = max(s["overhead"] for r in rows for s in r["strategies"].values())
    if worst >= 0.5:
        print(f"\ncaution: overheads reach {100 * worst:.0f} %: the model is first order (failures rare against the "
              "checkpoint interval and the recovery); such figures only say that the strategy does not scale there.")
    print("\nnone loses the failed shard's state at every failure; ecrec's parity overhead is held constant across "
          "cluster sizes; cpr* intervals come from the target PLS.", flush=True)


def write_plot(path: str, rows: list[dict], config: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullLocator
    except ImportError:
        print("ecrec-bench simulate: --plot needs matplotlib (pip install matplotlib); no plot written", file=sys.stderr)
        return False
    xs = [r["servers"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 5))
    ys_all = []
    for name in STRATEGIES:
        ys = [100 * r["strategies"][name]["overhead"] for r in rows]
        ys_all += ys
        ax.plot(xs, ys, marker="o", label=name, linewidth=1.4)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    if all(y > 0 for y in ys_all):
        ax.set_yscale("log")
    ax.set_xlabel("embedding servers")
    ax.set_ylabel("expected overhead, % of training time (modelled)")
    ax.set_title(f"{config['model_gb']:g} GB model, per-server MTBF {config['mtbf_hours']:g} h")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(args) -> int:
    if args.reschedule_s is not None and not (math.isfinite(args.reschedule_s) and args.reschedule_s >= 0):
        print("ecrec-bench simulate: --reschedule-s must be finite and >= 0", file=sys.stderr)
        return 2
    try:
        inputs, notes = resolve_inputs(args)
        for name, inp in inputs.items():
            check_input(name, inp.value)
    except FileNotFoundError:
        print(f"ecrec-bench simulate: no such file {args.from_compare!r}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as exc:
        print(f"ecrec-bench simulate: {args.from_compare!r} is not JSON: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        where = f" (from {args.from_compare!r})" if args.from_compare else ""
        print(f"ecrec-bench simulate: {exc}{where}", file=sys.stderr)
        return 2
    config = {"servers": list(args.servers), "mtbf_hours": args.mtbf_hours, "model_gb": args.model_gb,
              "formula": args.formula, "storage_gbps": args.storage_gbps, "from_compare": args.from_compare,
              "strategies": list(STRATEGIES)}
    storage = args.storage_gbps * GB if args.storage_gbps else None
    rows = [simulate_row(n, args.mtbf_hours, args.model_gb * GB, inputs, args.formula, storage) for n in args.servers]
    print_report(config, inputs, notes, rows)
    if args.json:
        report = {"config": config, "inputs": {k: v.to_dict() for k, v in inputs.items()},
                  "inputs_not_measured": notes, "rows_source": "modelled", "rows": rows}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot and write_plot(args.plot, rows, config):
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
