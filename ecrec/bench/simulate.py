"""``ecrec-bench simulate``: CPR's checkpoint overhead model at production scale, fed with measured costs.

``ecrec-bench compare`` measures every strategy on a small local cluster, where a failure
happens once, on purpose.  What matters in production is the *expected* overhead of a job
on hundreds of servers that fail at random.  This command evaluates the overhead model of
the CPR paper (Maeng et al., MLSys 2021; the functions of ``baselines/overhead.py``) over growing clusters,
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

Cost basis ``fit`` (the default, issue 24): one save cost for every checkpointing strategy,
``o_save = save_latency_s + shard / save_fit_bytes_per_s``, a least-squares fit of fixed latency plus
bytes / bandwidth over the measured persisted saves of different sizes (:func:`fit_latency_bandwidth`;
the fit and its points are printed and written to the JSON); loads and ECRec's rebuild are fitted the
same way.  ``cpr``, ``cpr-mfu`` and ``cpr-ssu`` each report CPR's plan, the lower of their partial and
full recovery overheads (``plan``).  ECRec's parity overhead is ``parity_s_per_update x
updates_per_server_s`` (a pooled median over every paired round of the current runs, at their m = 1; scaled by
``m``: a delta to each parity row), and it pays for
data loss: ``m + 1`` failures in one stripe during a rebuild (:func:`data_loss_probability`, from the
per-server MTBF, the rebuild time and the layout of ``ecrec/coding/layout.py``), bounded by periodic snapshots
at Daly's interval for the loss rate (:func:`snapshot_fallback`, rates of ``ecrec-bench snapshot``).
``--from-results DIR`` takes every measured input from the result files of DIR (:func:`measured_results`);
the built-in :data:`DEFAULTS` are those of ``docs/results``.  ``--basis overhead`` keeps the earlier
basis: each checkpointing strategy charged its measured failure-free overhead per save
(``{full,cpr,mfu,ssu}_save_bytes_per_s``) and ECRec a constant ``parity_overhead``.  The training stall
alone (``stall_latency_s + shard / save_bytes_per_s``) is shown beside as "stall only".
``--paper-check`` prints CPR's headline beside the simulated figures with the relative error.

Costs scale with the shard: ``o_save = shard / save_rate`` (per server, servers saving in
parallel), ``o_load = shard / load_rate``; ``--storage-gbps``
caps the aggregate bandwidth of the checkpoint store (then a full save or a full rollback
takes at least ``model / storage``).  Every input carries its ``source``: ``measured``
(taken from the compare report), ``modelled`` (inferred from measured figures through an
assumption, e.g. all of ``full``'s slowdown put on its saves when the report lacks the
driver's save stall), ``default`` (built in; see :data:`DEFAULTS` for how each was
obtained) or ``given`` (``--set NAME=VALUE``, ``--target-pls``, ``--reschedule-s``).  Every
output figure is modelled.

Examples::

    # CPR's headline (full 8.2-8.5 %, CPR-MFU/SSU 0.53-0.68 %) from the measured inputs (docs/results.md)
    ecrec-bench simulate --from-results docs/results --servers 8 --model-gb 192.5 \\
        --job-mtbf-hours 20.5 --target-pls 0.02 --paper-check
    # growing clusters, per-server MTBF 24 h, a 100 GB model, JSON with the fits
    ecrec-bench simulate --from-results docs/results --servers 8..1024 --json sim.json
    # ECRec with two parities; the earlier cost basis; one input overridden
    ecrec-bench simulate --servers 64 --k 4 --m 2
    ecrec-bench simulate --basis overhead --from-compare docs/results/compare-quick.json
    ecrec-bench simulate --set save_fit_bytes_per_s=1e9 --reschedule-s 120
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


# Built-in costs, regenerated from the result files kept in docs/results/ (issue 24) with
# `ecrec-bench simulate --from-results docs/results --json OUT` (see :func:`measured_results`, which
# says how each is measured; `tests/test_simulate.py` checks that these values still equal what those files
# give).  The files: the current compare reports (paired rounds) compare-quick.json, compare-quick-2.json and
# compare-quick-3.json (`--preset quick --equal-pls`: 4 servers, 8 tables x 20,000 rows x dim 16, Adagrad; packed
# checkpoints), compare-quick-per-table.json (the same preset with one checkpoint file per table, an earlier run:
# the small sizes of the per-table fits), compare-movielens.json and
# compare-realistic.json / compare-realistic-run1.json (`--preset realistic`; packed checkpoints, so their saves
# are left out of the per-table save, stall and load fits: FIT_LAYOUT);
# recovery-default.json (400k x 64 rows), recovery-4m-idle.json, recovery-4m-training.json, recovery-4m-ecrec-*.json,
# recovery-4m-through-*.json and recovery-4m-idle-ecrec-*.json (4M x 64 rows, 2.05 GB), snapshot-4m-*.json.
# compare-quick-run1.json (no paired rounds, a machine at load 30-48) is left out, and so are
# recovery-4m-paced-*.json (a strategy option set: a paced rebuild, not the defaults modelled).
# The legacy overhead basis (`--basis overhead`: `{full,cpr,mfu,ssu}_save_bytes_per_s`, `parity_overhead`)
# comes from compare-quick-per-table.json through :func:`inputs_from_compare`, except `parity_overhead`, the pooled
# parity cost below x its update rate.  Absolute rates are those of this Python prototype on a 2-core shared
# VM writing to a local disk, not of a production parameter server.
_RES = "docs/results"
_QUICK = "compare-quick-per-table.json"
DEFAULTS: dict[str, tuple[float, str, str]] = {
    "save_bytes_per_s": (353.6e6, "bytes/s per server",
                         f"{_RES}: training stall per save, fit over 5 drivers' o_save_s (0.11-512 MB per server; with "
                         "stall_latency_s); the 'stall only' figures"),
    "full_save_bytes_per_s": (63.73e6, "bytes/s per server",
                              f"{_QUICK} (--basis overhead): full's overhead +15.5 % x its interval 0.518 s = 80.3 ms "
                              "per 5.12 MB save"),
    "cpr_save_bytes_per_s": (77.98e6, "bytes/s per server",
                             f"{_QUICK} (--basis overhead): cpr's +0.9 % (within noise) is below its stall: the stall "
                             "65.7 ms per save"),
    "mfu_save_bytes_per_s": (39.19e6, "bytes/s per server",
                             f"{_QUICK} (--basis overhead): cpr-mfu's +8.7 % (within noise) x 1.608 s / 1.067 = "
                             "130.7 ms per save"),
    "ssu_save_bytes_per_s": (37.81e6, "bytes/s per server",
                             f"{_QUICK} (--basis overhead): cpr-ssu's +2.8 % (within noise) is below its stall: the "
                             "stall 135.4 ms per save"),
    "load_bytes_per_s": (476.4e6, "bytes/s per server",
                         f"{_RES}: one server's checkpoint reload, fit over 5 points (0.11-520 MB; with load_latency_s)"),
    "reschedule_s": (0.09053, "s", f"{_RES}: median promotion_s of none in 12 runs (kill -> a local standby serving); "
                                  "production schedulers take far longer, see --reschedule-s"),
    "parity_overhead": (0.09060, "fraction", "(--basis overhead) parity_s_per_update x updates_per_server_s"),
    "rebuild_bytes_per_s": (411.4e6, "bytes/s per server",
                            f"{_RES}: ECRec rebuilds (data + parity rows of the replacement), fit over 21 points "
                            "(0.15-768 MB, some of them while training; with rebuild_latency_s)"),
    "recovery_throughput_ratio": (0.4410, "fraction", f"{_RES}: median of ECRec's useful throughput while "
                                                      "recovering in 14 runs"),
    "target_pls": (0.01, "fraction", "CPR's accuracy bound on lost updates (a choice, not a measurement)"),
    "partial_saves_per_interval": (4.0, "saves", "r: cpr-mfu/ssu save hot rows every interval / r (baselines.cpr's default)"),
    "mfu_save_fraction": (0.04053, "fraction", "f: median over the compare reports of cpr-mfu's rows per partial save "
                                               "of their shards (the quick runs and the realistic ones)"),
    "mfu_update_coverage": (0.8053, "fraction", "h, the compare reports (modelled): from cpr-mfu's equal-PLS replays "
                                                "(g of cpr's updates left unsaved), h = (1 - g) / (1 - 1/r)"),
    "ssu_save_fraction": (0.1043, "fraction", "f: the same median for cpr-ssu"),
    "ssu_update_coverage": (0.9317, "fraction", "h, the compare reports (modelled): the same for cpr-ssu's replays "
                                                "(a g below 1/r clamped to 1)"),
    # --- the fit basis (issue 24) ---
    "save_latency_s": (0.05211, "s", f"{_RES}: persisted saves of full/cpr, fit latency + bytes / bandwidth over 16 "
                                     "points (0.11-520 MB per server, rms relative residual 27 %)"),
    "save_fit_bytes_per_s": (86.92e6, "bytes/s per server", f"{_RES}: the same fit's bandwidth (4 servers writing to "
                                                            "one local disk at once)"),
    "stall_latency_s": (0.006744, "s", f"{_RES}: training stall per save, the fit's latency (see save_bytes_per_s)"),
    "load_latency_s": (0.002091, "s", f"{_RES}: one server's reload, the fit's latency (see load_bytes_per_s)"),
    "rebuild_latency_s": (0.2589, "s", f"{_RES}: ECRec rebuild, the fit's latency (see rebuild_bytes_per_s)"),
    "parity_s_per_update": (4.756e-6, "s per row update",
                            f"{_RES}: pooled median of 88 paired measurements from 11 runs (the rounds of each compare "
                            "report, the recovery runs at 4M rows) of slowdown x step / row updates per server per "
                            "step; 95 % interval +2.07 to +6.37 us"),
    "updates_per_server_s": (19049.0, "row updates/s per server", f"{_RES}: median row-update rate per server of "
                                                                  "those 11 runs"),
    "snapshot_bytes_per_s": (139.3e6, "bytes/s per server", "snapshot-4m-{1,2,3}.json: the median of 2,049 MB over 4 "
                                                            "servers in 4.11, 3.53 and 3.68 s"),
    "snapshot_restore_bytes_per_s": (176.0e6, "bytes/s per server", "snapshot-4m-{1,2,3}.json: the median of 2,049 MB "
                                                                    "onto 3 servers in 4.60, 3.76 and 3.88 s (in bulk)"),
}

#: the inputs :func:`measured_results` regenerates from the result files (the rest are choices or legacy)
REGENERATED = ("save_bytes_per_s", "load_bytes_per_s", "reschedule_s", "rebuild_bytes_per_s", "recovery_throughput_ratio",
               "mfu_save_fraction", "mfu_update_coverage", "ssu_save_fraction", "ssu_update_coverage", "save_latency_s",
               "save_fit_bytes_per_s", "stall_latency_s", "load_latency_s", "rebuild_latency_s", "parity_s_per_update",
               "updates_per_server_s", "snapshot_bytes_per_s", "snapshot_restore_bytes_per_s")


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
    """Expected overhead of every strategy on ``servers`` servers, on the legacy ``overhead`` cost basis.

    Each checkpointing strategy is charged its own measured failure-free overhead per save
    (``{full,cpr,mfu,ssu}_save_bytes_per_s``) and ECRec the constant ``parity_overhead``; ``cpr``, ``cpr-mfu``
    and ``cpr-ssu`` report CPR's plan (``plan``: the lower of partial and full recovery).  The ``fit`` basis,
    the command's default, is :func:`simulate_row_fit`.
    """
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

    def full_plan(o: float) -> dict:
        t, ov = full_at(o)
        return {"overhead": ov, "interval_s": t, "o_save_s": o, "o_load_s": o_load_all, "pls": 0.0}

    # CPR's plan (issue 24): each of cpr, cpr-mfu, cpr-ssu falls back to full recovery (at its own save cost)
    # where that costs less; "overhead" is the plan's, "partial_overhead" the partial figure
    partial = {"overhead": overhead.partial_overhead(t_part, o_save["cpr"], o_load_one, mtbf, o_res),
               "interval_s": t_part, "o_save_s": o_save["cpr"], "o_load_s": o_load_one,
               "pls": overhead.expected_pls(t_part, n, mtbf)}
    out["cpr"] = {**plan_min(partial, full_plan(o_save["cpr"])),
                  "overhead_stall_only": min(overhead.partial_overhead(t_part, o_stall, o_load_one, mtbf, o_res),
                                             full_at(o_stall)[1]),
                  "o_save_stall_s": o_stall}
    out["cpr"]["plan_overhead"] = out["cpr"]["overhead"]
    for name, key in (("cpr-mfu", "mfu"), ("cpr-ssu", "ssu")):
        args = (o_load_one, mtbf, n, p, v[f"{key}_save_fraction"], v[f"{key}_update_coverage"],
                v["partial_saves_per_interval"], o_res)
        t, o, pls = hot_partial_overhead(o_save[name], *args)
        hot = {"overhead": o, "interval_s": t, "o_save_s": o_save[name], "o_load_s": o_load_one, "pls": pls}
        out[name] = {**plan_min(hot, full_plan(o_save[name])),
                     "overhead_stall_only": min(hot_partial_overhead(o_stall, *args)[1], full_at(o_stall)[1]),
                     "o_save_stall_s": o_stall}

    rebuild_s = shard / v["rebuild_bytes_per_s"]
    out["ecrec"] = {"overhead": ecrec_overhead(v["parity_overhead"], o_res, rebuild_s, v["recovery_throughput_ratio"], mtbf),
                    "rebuild_s": rebuild_s, "pls": 0.0}
    out["none"] = {"overhead": none_overhead(o_res, mtbf), "pls": None,
                   "note": "every failure loses the failed shard's state"}
    return {"servers": n, "job_mtbf_s": mtbf, "shard_bytes": shard, "failures_per_day": 86400.0 / mtbf,
            "basis": "overhead", "strategies": out}


def simulate_row_fit(servers: int, mtbf_hours: float, model_bytes: float, inputs: dict[str, Input],
                     formula: str = "daly", storage_bytes_per_s: float | None = None, k: int = 2, m: int = 1,
                     ecrec_servers_in_stripe: bool = True) -> dict:
    """The ``fit`` cost basis (issue 24): one save cost for every checkpointing strategy, CPR's plan for each.

    ``o_save = save_latency_s + shard / save_fit_bytes_per_s`` for ``full``, ``cpr``, ``cpr-mfu``, ``cpr-ssu``
    (a save costs its whole persisted write: on the measured runs that write competes with training);
    ``o_load = load_latency_s + shard / load_bytes_per_s``.  ``cpr``, ``cpr-mfu`` and ``cpr-ssu`` each report
    CPR's plan: the lower of their partial-recovery overhead and full recovery's (``plan``).  ECRec:
    ``parity = parity_s_per_update x updates_per_server_s x m / PARITY_MEASURED_M`` (a delta to each of m parity
    rows); per failure the reschedule and the part of the
    rebuild (``rebuild_latency_s + shard (1 + m/k) / rebuild_bytes_per_s``) training does not overlap; plus the
    data loss of ``m + 1`` failures in a stripe during the rebuild (:func:`data_loss_probability`) and the
    periodic snapshots that bound its cost (:func:`snapshot_fallback`).
    """
    v = {name: inp.value for name, inp in inputs.items()}
    n = int(servers)
    server_mtbf = mtbf_hours * 3600.0
    mtbf = server_mtbf / n
    shard = model_bytes / n
    o_res = v["reschedule_s"]

    def capped(own_s: float, total_bytes: float) -> float:
        return max(own_s, total_bytes / storage_bytes_per_s) if storage_bytes_per_s else own_s

    o_save = capped(v["save_latency_s"] + shard / v["save_fit_bytes_per_s"], model_bytes)
    o_stall = capped(v["stall_latency_s"] + shard / v["save_bytes_per_s"], model_bytes)
    o_load_one = capped(v["load_latency_s"] + shard / v["load_bytes_per_s"], shard)
    o_load_all = capped(v["load_latency_s"] + shard / v["load_bytes_per_s"], model_bytes)
    p = v["target_pls"]
    out: dict = {}

    def full_at(o: float) -> dict:
        t = overhead.optimal_full_interval(o, mtbf, formula)
        return {"overhead": overhead.full_overhead(t, o, o_load_all, mtbf, o_res), "interval_s": t, "o_save_s": o,
                "o_load_s": o_load_all, "pls": 0.0}

    full = full_at(o_save)
    out["full"] = {**full, "overhead_stall_only": full_at(o_stall)["overhead"], "o_save_stall_s": o_stall}
    t_part = overhead.interval_for_pls(p, n, mtbf)

    def partial_at(o: float) -> dict:
        return {"overhead": overhead.partial_overhead(t_part, o, o_load_one, mtbf, o_res), "interval_s": t_part,
                "o_save_s": o, "o_load_s": o_load_one, "pls": overhead.expected_pls(t_part, n, mtbf)}

    out["cpr"] = {**plan_min(partial_at(o_save), full),
                  "overhead_stall_only": plan_min(partial_at(o_stall), full_at(o_stall))["overhead"],
                  "o_save_stall_s": o_stall}
    for name, key in (("cpr-mfu", "mfu"), ("cpr-ssu", "ssu")):
        args = (o_load_one, mtbf, n, p, v[f"{key}_save_fraction"], v[f"{key}_update_coverage"],
                v["partial_saves_per_interval"], o_res)

        def hot(o: float) -> dict:
            t, ov, pls = hot_partial_overhead(o, *args)
            return {"overhead": ov, "interval_s": t, "o_save_s": o, "o_load_s": o_load_one, "pls": pls}

        out[name] = {**plan_min(hot(o_save), full), "overhead_stall_only": plan_min(hot(o_stall), full_at(o_stall))["overhead"],
                     "o_save_stall_s": o_stall}

    rebuild_s = v["rebuild_latency_s"] + shard * (1.0 + m / k) / v["rebuild_bytes_per_s"]
    # each row update sends its delta to m parity rows and is applied there: the measured cost (its runs kept
    # RS(k, PARITY_MEASURED_M)) scales with m, none with m = 0 (and every failure then loses data)
    parity = v["parity_s_per_update"] * v["updates_per_server_s"] * m / PARITY_MEASURED_M
    base = ecrec_overhead(parity, o_res, rebuild_s, v["recovery_throughput_ratio"], mtbf)
    p_loss = data_loss_probability(rebuild_s, server_mtbf, k, m, n)
    o_snap = capped(shard / v["snapshot_bytes_per_s"], model_bytes)
    o_restore = capped(shard / v["snapshot_restore_bytes_per_s"], model_bytes)
    snap = snapshot_fallback(p_loss / mtbf, o_snap, o_restore, o_res, formula)
    out["ecrec"] = {"overhead": base + snap["overhead"], "overhead_without_loss": base, "parity_overhead": parity,
                    "rebuild_s": rebuild_s, "pls": 0.0, "data_loss_probability_per_failure": p_loss,
                    "data_loss_per_year": p_loss / mtbf * 365.25 * 86400, "snapshot": snap, "k": k, "m": m}
    out["none"] = {"overhead": none_overhead(o_res, mtbf), "pls": None,
                   "note": "every failure loses the failed shard's state"}
    return {"servers": n, "job_mtbf_s": mtbf, "shard_bytes": shard, "failures_per_day": 86400.0 / mtbf,
            "basis": "fit", "strategies": out}


#: the m of the runs ``parity_s_per_update`` was measured on (every recorded compare, recovery and profile run
#: keeps RS(2, 1)); the fit basis scales ECRec's parity cost by ``m / PARITY_MEASURED_M``
PARITY_MEASURED_M = 1


# --- ECRec's data loss (m + 1 failures in one stripe during a rebuild) and its snapshot fallback -------------
def stripe_loss_sets(k: int, m: int, servers: int) -> int:
    """How many sets of ``m`` other servers lose data together with one failed server.

    ``ecrec/coding/layout.py`` puts stripe ``s`` on the ``k + m`` consecutive servers ``(s + t) % S``: a failed
    server shares stripes with the windows of ``k + m`` servers that contain it, and ``m`` more failures
    inside one such window leave a stripe with fewer than ``k`` members.  Counts the distinct ``m``-sets.
    """
    import itertools

    k, m, servers = int(k), int(m), int(servers)
    if k < 1 or m < 0 or k + m > servers:
        raise ValueError(f"need k >= 1, m >= 0, k + m <= servers (k={k}, m={m}, servers={servers})")
    if m == 0:
        return 1  # any failure loses data
    sets = set()
    w = k + m
    for start in range(-(w - 1), 1):
        members = {(start + t) % servers for t in range(w)} - {0}
        sets.update(frozenset(c) for c in itertools.combinations(sorted(members), m))
    return len(sets)


def data_loss_probability(rebuild_s: float, server_mtbf_s: float, k: int, m: int, servers: int) -> float:
    """Probability that one failure ends in data loss: ``m`` more servers of a stripe fail before its rebuild ends.

    Each server fails independently at rate ``1 / server_mtbf_s``; during the rebuild window ``R`` one fails
    with ``q = 1 - exp(-R / MTBF)``; with ``C`` = :func:`stripe_loss_sets` sets that would lose a stripe,
    ``P = 1 - (1 - q^m)^C`` (first order: failures during the window do not extend it).
    """
    if rebuild_s < 0:
        raise ValueError(f"rebuild_s must be >= 0, got {rebuild_s}")
    q = 1.0 - math.exp(-float(rebuild_s) / _mtbf(server_mtbf_s))
    if int(m) == 0:
        return 1.0
    c = stripe_loss_sets(k, m, servers)
    return 1.0 - (1.0 - q ** int(m)) ** c


def snapshot_fallback(loss_rate: float, o_snap: float, o_restore: float, o_res: float,
                      formula: str = "daly") -> dict:
    """Periodic snapshots for the rare data loss: Daly's interval for the loss rate, and their overhead.

    ``O = o_snap / T + loss_rate * (o_restore + o_res + T / 2)`` (a loss rolls everything back to the last
    snapshot, as full recovery does).  With no loss (``loss_rate = 0``) no snapshot is needed: ``O = 0``.
    """
    if loss_rate <= 0:
        return {"interval_s": None, "overhead": 0.0, "loss_rate_per_s": 0.0, "o_snapshot_s": o_snap,
                "o_restore_s": o_restore}
    mtbl = 1.0 / loss_rate
    t = overhead.optimal_full_interval(max(o_snap, 1e-9), mtbl, formula)
    o = overhead.full_overhead(t, o_snap, o_restore, mtbl, o_res)
    return {"interval_s": t, "overhead": o, "loss_rate_per_s": loss_rate, "o_snapshot_s": o_snap,
            "o_restore_s": o_restore}


# --- CPR's plan for each checkpointing strategy -------------------------------------------------------------
def plan_min(partial: dict, full: dict) -> dict:
    """CPR's choice: partial recovery when its modelled overhead is below full recovery's, else full."""
    chosen = partial if partial["overhead"] < full["overhead"] else full
    return {**chosen, "plan": "partial" if chosen is partial else "full",
            "partial_overhead": partial["overhead"], "full_overhead": full["overhead"],
            "partial_interval_s": partial["interval_s"], "full_interval_s": full["interval_s"]}


# --- CPR's headline (the CPR paper, MLSys 2021): what docs/results.md's headline command is checked against ---
#: strategy -> (low, high) of the overhead CPR reports (fraction of training time)
PAPER_CPR = {"full": (0.082, 0.085), "cpr-mfu": (0.0053, 0.0068), "cpr-ssu": (0.0053, 0.0068)}


def relative_error(value: float, low: float, high: float) -> float:
    """0 inside ``[low, high]``, else the signed distance to the nearer end relative to that end."""
    if low <= value <= high:
        return 0.0
    end = low if value < low else high
    return (value - end) / end


def paper_check(row: dict) -> dict:
    """Each headline strategy's simulated overhead beside CPR's figure, with the relative error."""
    out = {}
    for name, (lo, hi) in PAPER_CPR.items():
        x = row["strategies"][name]["overhead"]
        out[name] = {"simulated": x, "paper_low": lo, "paper_high": hi, "relative_error": relative_error(x, lo, hi),
                     "plan": row["strategies"][name].get("plan")}
    return out


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
    if not isinstance(report.get("reference"), dict):  # a recovery report has strategies too, and no reference run
        raise ValueError("not a compare report: no 'reference' run (a recovery or other report? simulate reads "
                         "ecrec-bench compare's JSON)")
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


# --- measured inputs from the result files (issue 24): fits, parity per update, rebuild, snapshot ----------
def fit_latency_bandwidth(points, relative: bool = True) -> dict:
    """Least-squares fit ``seconds = latency + bytes / bandwidth`` over measured ``(bytes, seconds)`` points.

    ``relative`` weighs each point by ``1 / seconds**2`` (the relative error is minimised), so a small save
    (mostly fixed latency) and a large one (mostly bandwidth) both count; plain least squares is dominated
    by the largest points.  A negative latency is clamped to 0 and the bandwidth refitted through the
    origin.  Needs sizes at least a factor 2 apart (sizes a few per cent apart fit only noise).  Returns ``latency_s``, ``bytes_per_s``, ``points`` (sorted),
    ``rms_relative_residual`` and ``method``.
    """
    pts = sorted((float(b), float(s)) for b, s in points)
    if any(not (math.isfinite(b) and math.isfinite(s)) or b < 0 or s <= 0 for b, s in pts):
        raise ValueError("fit points need bytes >= 0 and seconds > 0")
    if len({b for b, _ in pts}) < 2 or pts[-1][0] < 2 * pts[0][0]:
        raise ValueError(f"a latency + bandwidth fit needs saves of at least two sizes a factor 2 or more apart, got "
                         f"{len(pts)} point(s) of {pts[0][0] / MB:.4g}-{pts[-1][0] / MB:.4g} MB" if pts else
                         "a latency + bandwidth fit needs saves of at least two sizes, got none")
    w = [1.0 / (s * s) if relative else 1.0 for _, s in pts]
    sw = sum(w)
    sx = sum(wi * b for wi, (b, _) in zip(w, pts))
    sy = sum(wi * s for wi, (_, s) in zip(w, pts))
    sxx = sum(wi * b * b for wi, (b, _) in zip(w, pts))
    sxy = sum(wi * b * s for wi, (b, s) in zip(w, pts))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det
    latency = (sy - slope * sx) / sw
    method = ("weighted least squares (weights 1/seconds^2: relative error)" if relative else "least squares")
    if latency < 0 or slope <= 0:
        latency = 0.0
        slope = sxy / sxx
        method += "; latency clamped to 0, bandwidth fitted through the origin"
    if slope <= 0:
        raise ValueError("the fit gives no positive bandwidth: the larger saves were not slower")
    resid = [((latency + slope * b) - s) / s for b, s in pts]
    return {"latency_s": latency, "bytes_per_s": 1.0 / slope, "points": [[b, s] for b, s in pts],
            "rms_relative_residual": math.sqrt(sum(r * r for r in resid) / len(resid)), "method": method}


#: the files of a results directory :func:`measured_results` leaves out (:func:`_load_json` gives None)
NOT_RESULT_FILES = "not result files (not JSON, not an object, or a config that is not one)"


def _load_json(path) -> dict | None:
    """A result file's object, or None for a file that is none (not JSON -- cut short, empty, not UTF-8 --, not an
    object, or with a config that is not an object)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        return None
    if not isinstance(data, dict) or not isinstance(data.get("config") or {}, dict):
        return None
    return data


def _is_current_compare(report: dict) -> bool:
    """A compare report measured with paired rounds (the protocol of the current ``compare``)."""
    st = report.get("strategies")
    return isinstance(st, dict) and any(
        isinstance(v, dict) and isinstance(v.get("overhead_spread"), dict) and v["overhead_spread"].get("log_ratios")
        for v in st.values())


def _bootstrap_median_ci(xs: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    import random

    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


#: the checkpoint layout whose saves the save, stall and load fits take (the cpr plugin's default, ``files``)
FIT_LAYOUT = "per-table"


def checkpoint_layout(config: dict) -> str:
    """The checkpoint layout a report's saves used: ``checkpoint_files`` (compare), a ``files=`` option
    (recovery's ``--option``), else ``per-table`` (the default, and the only layout before the option)."""
    if config.get("checkpoint_files"):
        return str(config["checkpoint_files"])
    for opt in config.get("option") or []:
        if isinstance(opt, str) and opt.startswith("files="):
            return opt.split("=", 1)[1]
    return "per-table"


def measured_results(results_dir, layout: str = FIT_LAYOUT) -> tuple[dict[str, Input], dict]:
    """Every input this model can take from the result files of ``results_dir`` (``ecrec-bench`` JSONs).

    - ``save_latency_s`` / ``save_fit_bytes_per_s``: :func:`fit_latency_bandwidth` over the persisted saves of
      ``full``/``cpr`` (per server, all servers writing at once): the one-shot checkpoints of ``recovery-*.json``
      (``checkpoint_write_s`` for ``checkpoint_bytes`` / servers) and the per-save means of the servers' stats in
      the current ``compare-*.json`` (``persist_s_total`` / ``saves`` for ``bytes_written`` / ``saves``);
    - ``stall_latency_s`` / ``save_bytes_per_s``: the same fit over the training stall per save (the drivers'
      ``o_save_s``: compare and recovery-during-training);
    - ``load_latency_s`` / ``load_bytes_per_s``: the fit over one server's reload (``cpr``'s ``reload_s`` in
      recovery, the drivers' ``o_load_s`` in compare);
    - ``rebuild_latency_s`` / ``rebuild_bytes_per_s``: the fit over ECRec's rebuilds (restored bytes = data and
      parity rows of the replacement; recovery's ``rebuild_s`` and compare's server stats);
    - ``parity_s_per_update``: the pooled median over every paired round of ECRec against its reference in the
      current compare reports (and recovery-during-training's ECRec/none throughput) of the training time one
      row update costs in parity work: ``(slowdown) x (failure-free step) / (row updates per server per step)``;
      ``updates_per_server_s``: the median row-update rate per server of those runs;
    - ``recovery_throughput_ratio``: median of ECRec's useful throughput while recovering;
    - ``reschedule_s``: median promotion of ``none`` (kill -> standby serving);
    - ``snapshot_bytes_per_s`` / ``snapshot_restore_bytes_per_s``: ``snapshot-*.json`` (per server);
    - MFU/SSU save fractions and update coverage: :func:`inputs_from_compare` of the current compare reports
      (median over reports).

    Recovery runs with a strategy option set (``--option``: another setting than the defaults modelled) are left
    out, listed in ``fits["files"]``.  The save, stall and load fits take the saves of one checkpoint ``layout``
    only (:func:`checkpoint_layout`;
    default ``per-table``, the layout measured at every size): a packed save (``files=one``: one file, one
    fsync) costs a different latency and bandwidth, and a fit over both layouts describes neither.  The reports
    of another layout are listed in ``fits["files"]["other checkpoint layout"]`` and still give ECRec's inputs.

    Returns ``(inputs, fits)``; ``fits`` holds each fit with its points and the pooled parity samples.
    """
    import glob
    import os

    found: dict[str, Input] = {}
    fits: dict = {}
    files = sorted(glob.glob(os.path.join(str(results_dir), "*.json")))
    reports = {os.path.basename(p): _load_json(p) for p in files}
    unreadable = sorted(k for k, v in reports.items() if not v)  # left out ({} too), and listed as such
    reports = {k: v for k, v in reports.items() if v}
    compares = {k: v for k, v in reports.items() if k.startswith("compare") and _is_current_compare(v)}
    recoveries = {k: v for k, v in reports.items() if (v.get("config") or {}).get("command") == "recovery"}
    # a run with a strategy option set measures that setting (e.g. a paced rebuild), not the defaults modelled here
    optioned = sorted(k for k, v in recoveries.items() if (v.get("config") or {}).get("option"))
    recoveries = {k: v for k, v in recoveries.items() if k not in optioned}
    snapshots = {k: v for k, v in reports.items() if (v.get("config") or {}).get("command") == "snapshot"}
    fits["files"] = {"compare (current: paired rounds)": sorted(compares), "recovery": sorted(recoveries),
                     "snapshot": sorted(snapshots),
                     "skipped": sorted(k for k in reports if k.startswith("compare") and k not in compares),
                     "strategy options set (not the defaults)": optioned,
                     NOT_RESULT_FILES: unreadable,
                     "other checkpoint layout": sorted(k for k, v in {**compares, **recoveries}.items()
                                                       if checkpoint_layout(v.get("config") or {}) != layout)}

    write, stall, load, rebuild = [], [], [], []
    for name, rep in recoveries.items():
        cfg = rep.get("config") or {}
        same_layout = checkpoint_layout(cfg) == layout
        servers = _num(cfg.get("servers")) or 0
        k, m = _num(cfg.get("k")) or 0, _num(cfg.get("m")) or 0
        st = rep.get("strategies") or {}
        for s in ("full", "cpr") if same_layout else ():
            row = st.get(s) or {}
            w, b = _num(row.get("checkpoint_write_s")), _num(row.get("checkpoint_bytes"))
            if w and b and servers:
                write.append((b / servers, w, f"{name} {s} checkpoint"))
            o, mb = _num(row.get("o_save_s")), _num(row.get("model_bytes"))
            if o and mb and servers:
                stall.append((mb / servers, o, f"{name} {s} o_save_s"))
        cpr = st.get("cpr") or {}
        r, rb = _num(cpr.get("reload_s")), _num(cpr.get("restored_bytes"))
        if r and rb and same_layout:
            load.append((rb, r, f"{name} cpr reload"))
        ec = st.get("ecrec") or {}
        r, rb = _num(ec.get("rebuild_s")), _num(ec.get("restored_bytes"))
        if r and rb:
            rebuild.append((rb, r, f"{name} ecrec rebuild"))
        elif ec.get("failures") and servers and k:
            shard = (_num(ec.get("model_bytes")) or 0) / servers
            for i, f in enumerate(ec["failures"]):
                red, promo = _num(f.get("redundant_s")), _num(f.get("promotion_s")) or 0.0
                if shard and red and red > promo:
                    rebuild.append((shard * (1 + m / k), red - promo, f"{name} ecrec failure {i} (while training)"))
    for name, rep in compares.items():
        cfg = rep.get("config") or {}
        st = rep.get("strategies") or {}
        dim = _num(cfg.get("embedding_dim"))
        shard = compare_shard_bytes(cfg)
        k, m = _num(cfg.get("k")) or 0, _num(cfg.get("m")) or 0
        for s in ("full", "cpr") if checkpoint_layout(cfg) == layout else ():
            for sid, x in ((st.get(s) or {}).get("stats") or {}).items():
                if not isinstance(x, dict) or x.get("partial_saves"):
                    continue
                n, b, t = _num(x.get("saves")), _num(x.get("bytes_written")), _num(x.get("persist_s_total"))
                if n and b and t:
                    write.append((b / n, t / n, f"{name} {s} server {sid}: mean of {n:.0f} saves"))
            d = (st.get(s) or {}).get("driver") or {}
            for key, acc in (("o_save_s", stall), ("o_load_s", load)):
                v = _num(d.get(key))
                # the shard the driver saved: its full saves' mean bytes (the report's config lacks some datasets' rows)
                per_save = [(_num(x.get("bytes_written")) or 0) / (_num(x.get("saves")) or 1)
                             for x in ((st.get(s) or {}).get("stats") or {}).values() if isinstance(x, dict)]
                size = statistics.median(per_save) if per_save and any(per_save) else shard
                if v and size:
                    acc.append((size, v, f"{name} {s} driver {key}"))
        for sid, x in ((st.get("ecrec") or {}).get("stats") or {}).items():
            if not isinstance(x, dict):
                continue
            rows = (_num(x.get("rows_rebuilt")) or 0) + (_num(x.get("parity_rows_rebuilt")) or 0)
            t = _num(x.get("rebuild_s"))
            if rows and t and dim:
                rebuild.append((rows * dim * 4.0 * _COMPARE_FLOATS_PER_WEIGHT, t, f"{name} ecrec server {sid} rebuild"))

    def put_fit(key: str, pts: list, lat_name: str, bw_name: str, what: str) -> None:
        try:
            fit = fit_latency_bandwidth([(b, s) for b, s, _ in pts])
        except ValueError as exc:
            fits[key] = {"error": str(exc), "points": [list(p) for p in pts]}
            return
        fit["points"] = [[b, s, label] for b, s, label in sorted(pts)]
        fits[key] = fit
        note = (f"{what}: fit over {len(pts)} measured points, {min(b for b, _, _ in pts) / MB:.3g}-"
                f"{max(b for b, _, _ in pts) / MB:.4g} MB per server, rms relative residual "
                f"{fit['rms_relative_residual']:.0%}")
        found[lat_name] = Input(fit["latency_s"], "s", "measured", note)
        found[bw_name] = Input(fit["bytes_per_s"], "bytes/s per server", "measured", note)

    put_fit("save", write, "save_latency_s", "save_fit_bytes_per_s", "persisted checkpoint save (full, cpr)")
    put_fit("stall", stall, "stall_latency_s", "save_bytes_per_s", "training stall per save (drivers' o_save_s)")
    put_fit("load", load, "load_latency_s", "load_bytes_per_s", "one server's checkpoint reload")
    put_fit("rebuild", rebuild, "rebuild_latency_s", "rebuild_bytes_per_s", "ECRec rebuild of a replacement")

    # parity: training time per row update, pooled over every paired round
    samples, rates = [], []
    for name, rep in compares.items():
        cfg = rep.get("config") or {}
        ec = (rep.get("strategies") or {}).get("ecrec") or {}
        lrs = (ec.get("overhead_spread") or {}).get("log_ratios") or []
        servers, steps = _num(cfg.get("servers")), _num(cfg.get("steps"))
        pushed = [_num(((x.get("server") or {}).get("rows") or {}).get("pushed"))
                  for x in (ec.get("stats") or {}).values() if isinstance(x, dict)]
        pushed = sum(p for p in pushed if p)
        ov, step = _num(ec.get("overhead_vs_none")), _num(ec.get("median_step_s"))
        if not (lrs and servers and steps and pushed and step and ov is not None):
            continue
        per_step = pushed / servers / steps  # row updates a server applies per training step
        base_step = step / (1.0 + ov)  # the failure-free step without parity work
        rates.append((per_step / base_step, name))
        samples += [((math.exp(lr) - 1.0) * base_step / per_step, f"{name} round {i}") for i, lr in enumerate(lrs)]
    for name, rep in recoveries.items():
        cfg = rep.get("config") or {}
        st = rep.get("strategies") or {}
        ec, no = st.get("ecrec") or {}, st.get("none") or {}
        a, b = _num(ec.get("samples_per_s_before")), _num(no.get("samples_per_s_before"))
        step = _num(no.get("median_step_s"))
        ids = (_num(cfg.get("batch_size")) or 0) * (_num(cfg.get("ids_per_sample")) or 0) * (_num(cfg.get("tables")) or 0)
        servers = _num(cfg.get("servers"))
        if a and b and step and ids and servers and cfg.get("during_training"):
            per_step = ids / servers  # ids looked up per step (an upper bound on the distinct rows updated)
            rates.append((per_step / step, name))
            samples.append(((b / a - 1.0) * step / per_step, f"{name} ecrec vs none samples/s before the kill"))
    if samples:
        xs = [x for x, _ in samples]
        med = statistics.median(xs)
        lo, hi = _bootstrap_median_ci(xs)
        fits["parity"] = {"samples": [[x, label] for x, label in samples], "median_s_per_update": med,
                          "ci95": [lo, hi], "rates": [[r, label] for r, label in rates]}
        found["parity_s_per_update"] = Input(
            max(med, 0.0), "s per row update", "measured",
            f"pooled median of {len(xs)} paired measurements from {len({l.split(' ')[0] for _, l in samples})} runs "
            f"(95 % interval {lo * 1e6:+.2f} to {hi * 1e6:+.2f} us): slowdown x failure-free step / row updates "
            "per server per step")
        rate = statistics.median(r for r, _ in rates)
        found["updates_per_server_s"] = Input(rate, "row updates/s per server", "measured",
                                              f"median of {len(rates)} runs' row-update rate per server")
    ratios = [(_num(((rep.get("strategies") or {}).get("ecrec") or {}).get(key)), name)
              for name, rep in {**compares, **recoveries}.items()
              for key in ("throughput_during_recovery_ratio", "throughput_ratio")]
    ratios = [(min(max(r, 0.0), 1.0), n) for r, n in ratios if r is not None]
    if ratios:
        found["recovery_throughput_ratio"] = Input(
            statistics.median(r for r, _ in ratios), "fraction", "measured",
            f"median of ECRec's useful throughput while recovering in {len(ratios)} runs")
    promos = [_num(((rep.get("strategies") or {}).get("none") or {}).get("promotion_s"))
              for rep in {**compares, **recoveries}.values()]
    promos = [p for p in promos if p]
    if promos:
        found["reschedule_s"] = Input(statistics.median(promos), "s", "measured",
                                      f"median promotion_s of none (kill -> standby serving) in {len(promos)} runs; "
                                      "production schedulers take far longer, see --reschedule-s")
    snaps, restores = [], []
    for name, rep in snapshots.items():
        servers = _num((rep.get("config") or {}).get("servers"))
        rservers = _num((rep.get("config") or {}).get("restore_servers")) or servers
        for key, acc, n in (("save", snaps, servers), ("restore", restores, rservers)):
            x = rep.get(key) or {}
            b, t = _num(x.get("bytes")), _num(x.get("seconds"))
            if b and t and n:
                acc.append((b / n / t, f"{name}: {b / MB:,.0f} MB over {n:.0f} servers in {t:.2f} s"))
    for key, acc in (("snapshot_bytes_per_s", snaps), ("snapshot_restore_bytes_per_s", restores)):
        if acc:
            found[key] = Input(statistics.median(r for r, _ in acc), "bytes/s per server", "measured",
                               f"{'; '.join(n for _, n in acc)} (one size: no latency fitted)")
    # MFU/SSU: what the current compare reports measure of their hot-row saves
    per: dict[str, list[tuple[float, str]]] = {}
    for name, rep in compares.items():
        got, _ = inputs_from_compare(rep)
        for key in ("mfu_save_fraction", "ssu_save_fraction", "mfu_update_coverage", "ssu_update_coverage"):
            if key in got:
                per.setdefault(key, []).append((got[key].value, f"{name}: {got[key].note}"))
    for key, acc in per.items():
        found[key] = Input(statistics.median(v for v, _ in acc), "fraction",
                           "modelled" if key.endswith("coverage") else "measured", "; ".join(n for _, n in acc))
    return found, fits


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
            values = out
        else:
            values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a range START..END or a comma list of integers") from None
    if not values or values[0] < 1 or values[-1] > MAX_SERVERS:
        raise argparse.ArgumentTypeError(f"{text!r}: server counts must be integers from 1 to {MAX_SERVERS:,}")
    return values


def _positive_float(text: str, least: float = 0.0, most: float = math.inf) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be finite and > 0")
    if not least <= x <= most:  # past them the model's figures overflow (or underflow) to inf or 0
        raise argparse.ArgumentTypeError(f"{text!r} must be from {least:g} to {most:g}")
    return x


def _bounded(least: float, most: float):
    """A positive float from ``least`` to ``most`` (argparse names the flag of a value out of them)."""
    def parse(text: str) -> float:
        return _positive_float(text, least, most)

    return parse


#: the bounds of the model's inputs on the command line: an MTBF from 3.6 s to 1,100 years, a model from a byte to an
#: exabyte, a store from a byte to an exabyte a second, up to a million servers
HOURS = _bounded(1e-3, 1e7)
GIGABYTES = _bounded(1e-9, 1e9)
MAX_SERVERS = 1_000_000


def _fraction(text: str) -> float:
    x = _positive_float(text)
    if x >= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1)")
    return x


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--servers", type=parse_servers, default=parse_servers("8..1024"),
                   help="cluster sizes: START..END (powers of two between) or a comma list (default 8..1024)")
    p.add_argument("--mtbf-hours", type=HOURS, default=24.0,
                   help="MTBF of one server in hours; the job's is this / servers (default 24)")
    p.add_argument("--model-gb", type=GIGABYTES, default=100.0,
                   help="embedding state (weights + optimizer state) in GB, spread over the servers (default 100)")
    p.add_argument("--from-compare", metavar="JSON", help="take the measured costs from an `ecrec-bench compare --json` report")
    p.add_argument("--target-pls", type=_fraction, help="cpr*: target portion of lost updates (default 0.01)")
    p.add_argument("--reschedule-s", type=float, help="reschedule cost per failure in seconds (overrides the measured one)")
    p.add_argument("--storage-gbps", type=GIGABYTES,
                   help="aggregate bandwidth of the checkpoint store in GB/s (default: unlimited, servers in parallel)")
    p.add_argument("--set", metavar="NAME=VALUE", type=_setting, action="append",
                   help="override one input, e.g. mfu_save_fraction=0.05 or mfu_update_coverage=0.6 "
                        f"(repeatable; inputs: {', '.join(DEFAULTS)})")
    p.add_argument("--from-results", metavar="DIR",
                   help="take every input the result files of DIR measure (ecrec-bench compare/recovery/snapshot "
                        "JSONs, e.g. docs/results): the save, load and rebuild fits, ECRec's parity cost per "
                        "update, the snapshot rates (see measured_results)")
    p.add_argument("--basis", choices=("fit", "overhead"), default="fit",
                   help="cost basis: fit (default: one save cost latency + bytes / bandwidth for every checkpointing "
                        "strategy, ECRec's parity per update, data loss and snapshots) or overhead (the earlier basis: "
                        "each strategy's measured failure-free overhead per save, a constant parity overhead)")
    p.add_argument("--job-mtbf-hours", type=HOURS,
                   help="MTBF of the whole job in hours (then a server's is this x servers); overrides --mtbf-hours")
    p.add_argument("--k", type=int, default=2, help="ECRec: data rows per stripe (default 2)")
    p.add_argument("--m", type=int, default=1, help="ECRec: parity rows per stripe (default 1)")
    p.add_argument("--paper-check", action="store_true",
                   help="print CPR's headline (full 8.2-8.5 %%, CPR-MFU/SSU 0.53-0.68 %%) beside each row's figures "
                        "with the relative error (0 inside the paper's range)")
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
    if getattr(args, "from_results", None):
        import os

        if os.path.exists(args.from_results) and not os.path.isdir(args.from_results):
            raise ValueError(f"--from-results {args.from_results}: a file, not a directory of result files (a "
                             "compare report goes to --from-compare)")
        if not os.path.isdir(args.from_results):
            raise FileNotFoundError(args.from_results)
        found, _ = measured_results(args.from_results)
        if not found:  # every input would silently be the built-in default
            raise ValueError(f"--from-results {args.from_results}: no result file there gives any input "
                             f"({', '.join(sorted(REGENERATED))}): point it at a directory of result JSONs "
                             "(docs/results)")
        inputs.update(found)
        notes += [f"{name}: not measured in {args.from_results}" for name in REGENERATED if name not in found]
    if args.from_compare:
        with open(args.from_compare) as f:
            report = json.load(f)
        found, more = inputs_from_compare(report)
        inputs.update(found)
        notes += more
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
    elif inp.unit == "s per row update":
        value = f"{inp.value * 1e6:.3g} us/update"
    else:
        value = f"{inp.value:.4g} {inp.unit}"
    return f"  {name:<29} {value:>15}  {inp.source:<8}  {inp.note}"


def _pct(fraction: float) -> str:
    x = 100.0 * fraction
    return f"{x:.3f}" if x == 0 or x >= 0.001 else f"{x:.1e}"


def _table(cells: list[list[str]]) -> None:
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


#: inputs each basis uses (the others are printed only with --json)
_FIT_ONLY = {"save_latency_s", "save_fit_bytes_per_s", "stall_latency_s", "load_latency_s", "rebuild_latency_s",
             "parity_s_per_update", "updates_per_server_s", "snapshot_bytes_per_s", "snapshot_restore_bytes_per_s"}
_OVERHEAD_ONLY = {"full_save_bytes_per_s", "cpr_save_bytes_per_s", "mfu_save_bytes_per_s", "ssu_save_bytes_per_s",
                  "parity_overhead"}


def print_report(config: dict, inputs: dict[str, Input], notes: list[str], rows: list[dict],
                 fits: dict | None = None) -> None:
    basis = config.get("basis", "overhead")
    print("ecrec-bench simulate: expected overhead of each strategy (the overhead model of the CPR paper, MLSys 2021)")
    storage = f", checkpoint store {config['storage_gbps']} GB/s" if config["storage_gbps"] else ""
    mtbf = (f"job MTBF {config['job_mtbf_hours']:g} h (a server's = that x N)" if config.get("job_mtbf_hours")
            else f"per-server MTBF {config['mtbf_hours']:g} h (job MTBF = {config['mtbf_hours']:g} h / N)")
    print(f"  model {config['model_gb']:g} GB over N servers, {mtbf}, {config['formula']} interval for full{storage}")
    source = " + ".join(x for x in (config.get("from_results"), config["from_compare"]) if x)
    print(f"  costs: {source or 'built-in defaults (regenerated from docs/results, see DEFAULTS)'}; "
          f"cost basis: {basis}")
    print("\ninputs (source: measured = from the result files, modelled = inferred from their figures through an "
          "assumption, default = built in, given = command line):")
    skip = _OVERHEAD_ONLY if basis == "fit" else _FIT_ONLY
    for name, inp in inputs.items():
        if name not in skip:
            print(_fmt_input(name, inp))
    for n in notes:
        print(f"  (default used) {n}")
    if basis == "fit":
        print("\ncost basis 'fit': every checkpointing strategy saves at o_save = save_latency_s + shard / "
              "save_fit_bytes_per_s (its whole persisted write); ECRec's parity = parity_s_per_update x "
              f"updates_per_server_s x m / {PARITY_MEASURED_M} (the measured runs' m); cpr, cpr-mfu, cpr-ssu each "
              "take CPR's plan (min of partial and full recovery)")
    for key, fit in (fits or {}).items():
        if isinstance(fit, dict) and "latency_s" in fit:
            print(f"  fit {key:<8} {fit['latency_s'] * 1e3:8.1f} ms + bytes / {fit['bytes_per_s'] / MB:7.1f} MB/s over "
                  f"{len(fit['points'])} points, rms relative residual {fit['rms_relative_residual']:.0%} ({fit['method']})")
    print("\nexpected overhead, % of failure-free training time (all modelled):")
    head = ["servers", "job MTBF h"] + list(STRATEGIES) + ["cpr PLS", "plan cpr/mfu/ssu"]
    cells = [head]
    for r in rows:
        s = r["strategies"]
        plans = "/".join(s[x].get("plan", "?") for x in ("cpr", "cpr-mfu", "cpr-ssu"))
        cells.append([str(r["servers"]), f"{r['job_mtbf_s'] / 3600:.3g}"]
                     + [_pct(s[name]["overhead"]) for name in STRATEGIES]
                     + [f"{s['cpr']['pls']:.4f}", plans])
    _table(cells)
    if any(r["strategies"][x].get("plan") == "full" for r in rows for x in ("cpr", "cpr-mfu", "cpr-ssu")):
        print("  (where the plan is full, the partial-recovery figure was higher; both are in the JSON)")
    if basis == "fit":
        print("\nECRec: parity, rebuild and data loss (m + 1 failures in one stripe before the rebuild ends; "
              "snapshots bound what a loss costs):")
        cells = [["servers", "parity %", "rebuild s", "P(loss)/failure", "losses/year", "snapshot every h",
                  "snapshots+loss %"]]
        for r in rows:
            e = r["strategies"]["ecrec"]
            snap = e["snapshot"]
            cells.append([str(r["servers"]), _pct(e["parity_overhead"]), f"{e['rebuild_s']:.1f}",
                          f"{e['data_loss_probability_per_failure']:.2e}", f"{e['data_loss_per_year']:.2e}",
                          f"{snap['interval_s'] / 3600:.3g}" if snap["interval_s"] else "-", _pct(snap["overhead"])])
        _table(cells)
    print("\ncheckpointing charged only its training stall per save (o_save = the drivers' stall"
          + (", fitted" if basis == "fit" else "") + "):")
    names = [n for n in CHECKPOINT_KEYS if n in STRATEGIES]
    cells = [["servers"] + [f"{n} (stall)" for n in names]]
    for r in rows:
        cells.append([str(r["servers"])] + [_pct(r["strategies"][n]["overhead_stall_only"]) for n in names])
    _table(cells)
    if config.get("paper_check"):
        print("\nCPR's headline (the CPR paper: full 8.2-8.5 %, CPR-MFU/SSU 0.53-0.68 %) beside the simulated "
              "figures (relative error: 0 inside the paper's range, else to its nearer end):")
        cells = [["servers", "strategy", "paper %", "simulated %", "rel. error", "plan"]]
        for r in rows:
            for name, c in r["paper_check"].items():
                cells.append([str(r["servers"]), name, f"{100 * c['paper_low']:.2f}-{100 * c['paper_high']:.2f}",
                              f"{100 * c['simulated']:.2f}", f"{c['relative_error']:+.1%}", c["plan"] or "full"])
        _table(cells)
    worst = max(s["overhead"] for r in rows for s in r["strategies"].values())
    if worst >= 0.5:
        print(f"\ncaution: overheads reach {100 * worst:.0f} %: the model is first order (failures rare against the "
              "checkpoint interval and the recovery); such figures only say that the strategy does not scale there.")
    tail = ("ecrec's parity per update is held constant across cluster sizes" if basis == "fit"
            else "ecrec's parity overhead is held constant across cluster sizes")
    print(f"\nnone loses the failed shard's state at every failure; {tail}; cpr* intervals come from the target PLS.",
          flush=True)


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
    k, m = getattr(args, "k", 2), getattr(args, "m", 1)
    if k < 1 or m < 0 or any(k + m > n for n in args.servers):
        print(f"ecrec-bench simulate: need --k >= 1, --m >= 0 and k + m <= every --servers (k={k}, m={m})",
              file=sys.stderr)
        return 2
    try:
        inputs, notes = resolve_inputs(args)
        for name, inp in inputs.items():
            check_input(name, inp.value)
        fits = measured_results(args.from_results)[1] if getattr(args, "from_results", None) else {}
    except (KeyError, TypeError, AttributeError, IndexError, ArithmeticError) as exc:  # a file's figures damaged
        source = " and ".join(f"{flag} {value}" for flag, value in (
            ("--from-results", getattr(args, "from_results", None)), ("--from-compare", args.from_compare)) if value)
        what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc) or type(exc).__name__
        print(f"ecrec-bench simulate: {source or 'the inputs'}: a result file is not as ecrec-bench wrote it ({what})",
              file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"ecrec-bench simulate: no such file {exc.filename or exc.args[0]!r}", file=sys.stderr)
        return 2
    except OSError as exc:  # a directory, no permission: said by name
        where = (f"--from-compare {args.from_compare}" if args.from_compare and exc.filename == args.from_compare
                 else f"--from-results {getattr(args, 'from_results', None)}: {exc.filename}")
        print(f"ecrec-bench simulate: {where}: cannot read it: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as exc:
        print(f"ecrec-bench simulate: {args.from_compare!r} is not JSON: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        where = f" (from {args.from_compare!r})" if args.from_compare else ""
        print(f"ecrec-bench simulate: {exc}{where}", file=sys.stderr)
        return 2
    left_out = fits.get("files", {}).get(NOT_RESULT_FILES)
    if left_out:  # said, not silently fitted without them
        print(f"ecrec-bench simulate: --from-results: left out, {NOT_RESULT_FILES}: {', '.join(left_out)}",
              file=sys.stderr)
    basis = getattr(args, "basis", "fit")
    job = getattr(args, "job_mtbf_hours", None)
    config = {"servers": list(args.servers), "mtbf_hours": args.mtbf_hours, "job_mtbf_hours": job,
              "model_gb": args.model_gb, "formula": args.formula, "storage_gbps": args.storage_gbps,
              "from_compare": args.from_compare, "from_results": getattr(args, "from_results", None), "basis": basis,
              "k": k, "m": m, "paper_check": bool(getattr(args, "paper_check", False)), "strategies": list(STRATEGIES)}
    storage = args.storage_gbps * GB if args.storage_gbps else None
    rows = []
    try:
        for n in args.servers:
            per_server_h = job * n if job else args.mtbf_hours
            if basis == "fit":
                row = simulate_row_fit(n, per_server_h, args.model_gb * GB, inputs, args.formula, storage, k, m)
            else:
                row = simulate_row(n, per_server_h, args.model_gb * GB, inputs, args.formula, storage)
            if config["paper_check"]:
                row["paper_check"] = paper_check(row)
            rows.append(row)
    except (ValueError, OverflowError, ZeroDivisionError) as exc:  # inputs (--set) whose figures overflow
        print(f"ecrec-bench simulate: the model cannot be computed from these inputs: {exc}", file=sys.stderr)
        return 2
    print_report(config, inputs, notes, rows, fits)
    if args.json:
        report = {"config": config, "inputs": {k_: v.to_dict() for k_, v in inputs.items()},
                  "inputs_not_measured": notes, "fits": fits, "rows_source": "modelled", "rows": rows}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot and write_plot(args.plot, rows, config):
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
