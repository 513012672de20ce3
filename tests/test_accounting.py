"""``ecrec.bench.accounting`` on synthetic step records: a rollback, a pause, a slow rebuild, noise, several
workers, the overhead of slices with its interval and the A/A row, and the figures recomputed from JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ecrec.bench import accounting as acc


def records(durations, steps=None, samples=10, t0=0.0, rewind=None, gaps=None, worker=0):
    """Step records; ``rewind``: {record index: step rolled back to}; ``gaps``: {record index: idle s before}."""
    out, t = [], t0
    steps = list(range(len(durations))) if steps is None else steps
    for i, (step, d) in enumerate(zip(steps, durations)):
        t += (gaps or {}).get(i, 0.0)
        out.append({"step": step, "start": t, "end": t + d, "samples": samples, "rank": worker,
                    "rewind_to": (rewind or {}).get(i), "rows": 5, "rows_by_server": {"1": 2}})
        t += d
    return out


def account(recs, kill_t, events=(), kind="erasure"):
    return acc.failure_accounts(recs, list(events), [{"time": kill_t}], kind)[0]


def test_a_run_without_loss_loses_nothing():
    recs = records([0.1] * 60)
    f = account(recs, 3.0)
    assert f["samples_per_s_before"] == pytest.approx(100.0)
    assert f["lost_training_s"] == pytest.approx(0.0, abs=1e-9)
    assert f["useful_throughput_ratio"] == pytest.approx(1.0)
    assert f["recovery_s"] == pytest.approx(0.1)


def test_a_pause():
    """The kill at 3.0 stops step 30 for 0.8 s (it takes 0.9 s): paused 0.8, nothing else."""
    recs = records([0.1] * 30 + [0.9] + [0.1] * 30)
    f = account(recs, recs[30]["start"])
    assert f["paused_s"] == pytest.approx(0.8)
    assert f["replayed_s"] == 0.0 and f["deficit_s"] == pytest.approx(0.0, abs=1e-9)
    assert f["lost_training_s"] == pytest.approx(0.8)
    assert f["max_stall_s"] == pytest.approx(0.9)


def test_a_rollback_is_replayed_and_the_window_waits_for_the_furthest_step():
    """Kill at 3.0 in step 30 (0.5 s), rolled back to step 25; 25..30 replayed; redundant long before that."""
    steps = list(range(31)) + list(range(25, 50))
    recs = records([0.1] * 30 + [0.5] + [0.1] * 25, steps, rewind={30: 25})
    events = [{"kind": "promoted", "index": 1, "wall_time": 3.2}, {"kind": "redundant", "index": 1, "wall_time": 3.3}]
    f = account(recs, recs[30]["start"], events, kind="checkpoint")
    assert f["paused_s"] == pytest.approx(0.5)
    assert f["replayed_s"] == pytest.approx(0.5)  # steps 25..29 again
    assert f["deficit_s"] == pytest.approx(0.0, abs=1e-9)
    assert f["lost_training_s"] == pytest.approx(1.0)
    # redundant at 3.3, but training passes step 29 only with the second step 30 (ends 4.1)
    assert f["window_end_t"] >= 4.1 - 1e-9
    assert f["promotion_s"] == pytest.approx(0.2) and f["fully_redundant_s"] == pytest.approx(0.3)


def test_a_slow_rebuild_is_a_deficit_until_redundant():
    """Kill at 3.0; step 30 stalls (0.4 s); a rebuild slows the next 20 steps to 0.15 s until redundancy."""
    recs = records([0.1] * 30 + [0.4] + [0.15] * 20 + [0.1] * 20)
    events = [{"kind": "redundant", "index": 1, "wall_time": 6.4}]
    f = account(recs, recs[30]["start"], events)
    assert f["paused_s"] == pytest.approx(0.3)
    assert f["deficit_s"] == pytest.approx(20 * 0.05)
    assert f["lost_training_s"] == pytest.approx(1.3)
    assert f["window_end_t"] == pytest.approx(6.4)  # step 50 ends at exactly 3.4 + 20 * 0.15
    assert f["fully_redundant_s"] == pytest.approx(3.4)


def test_the_rate_is_the_one_just_before_the_kill():
    """The job slowed to 0.2 s per step long before the kill (other work on the machine): a rate from the
    start of the run would see the same steps as a deficit; the rate just before the kill does not."""
    recs = records([0.1] * 100 + [0.2] * 100)
    f = account(recs, 10.0 + 0.2 * 60)
    assert f["samples_per_s_before"] == pytest.approx(50.0)
    assert f["lost_training_s"] == pytest.approx(0.0, abs=1e-9)


def test_harness_time_between_steps_counts_for_nobody():
    """Idle time between steps (the benchmark's checks, other strategies' slices) is not training time."""
    gaps = {i: 0.03 for i in range(1, 80)}
    gaps[40] = 5.0  # another strategy's slice
    recs = records([0.1] * 80, gaps=gaps)
    f = account(recs, recs[60]["start"] - 0.01)
    assert f["samples_per_s_before"] == pytest.approx(100.0)
    assert f["lost_training_s"] == pytest.approx(0.0, abs=1e-9)


def test_noise_bounds_the_figures_of_a_run_without_loss():
    """Steps of 0.1 s +- 20 %, no failure effect: lost training lies within its noise, either sign."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        recs = records(list(0.1 * (1 + 0.2 * rng.standard_normal(200))))
        events = [{"kind": "redundant", "index": 1, "wall_time": recs[150]["end"]}]
        f = account(recs, recs[100]["start"], events)
        assert abs(f["lost_training_s"]) <= f["lost_training_noise_s"] * 1.5, (seed, f)
        assert f["lost_training_noise_s"] < 0.5


def test_each_failure_measures_its_own_rate_after_the_previous_window():
    recs = records([0.1] * 30 + [0.6] + [0.1] * 39 + [0.2] * 60 + [0.5] + [0.2] * 30)
    kills = [{"time": recs[30]["start"], "phase": 0.25}, {"time": recs[130]["start"], "phase": 0.75}]
    first, second = acc.failure_accounts(recs, [], kills, "erasure")
    assert first["samples_per_s_before"] == pytest.approx(100.0)
    assert second["samples_per_s_before"] == pytest.approx(50.0)
    assert first["lost_training_s"] == pytest.approx(0.5) and second["lost_training_s"] == pytest.approx(0.3)
    assert second["phase"] == 0.75
    summary = acc.failure_summary([first, second])
    assert summary["lost_training_s"] == pytest.approx(0.4)
    assert summary["lost_training_s_range"] == pytest.approx([0.3, 0.5])


def test_two_workers_are_costed_each_at_its_own_rate():
    a = records([0.1] * 60, worker=0)
    b = records([0.05] * 60 + [0.35] + [0.05] * 60, worker=1)
    recs = sorted(a + b, key=lambda r: r["end"])
    f = account(recs, 3.0)
    assert f["lost_training_s"] == pytest.approx((0.0 + 0.3) / 2)  # the mean over the workers that met it
    rate, _ = acc.failure_free_rate(recs, 3.0, None)
    assert rate > 0


def test_step_columns_round_trip_through_json_gives_the_same_figures():
    steps = list(range(31)) + list(range(25, 50))
    recs = records([0.1] * 30 + [0.5] + [0.1] * 25, steps, rewind={30: 25})
    saved = json.loads(json.dumps(acc.step_columns(recs, failed_server=1)))
    assert set(saved) == set(acc.STEP_FIELDS)
    assert saved["useful"][30] is False and saved["useful"][31] is False and saved["useful"][36] is True
    back = acc.step_records(saved)
    kill_t = recs[30]["start"]
    assert account(back, kill_t) == account(recs, kill_t)
    assert acc.lost_updates_of_none(back, kill_t) == 2 * 30


# --- overhead -------------------------------------------------------------------------------------------
def slices(rates_by_run: dict, cpu_per_sample: dict | None = None, samples: int = 1000) -> list[dict]:
    """One slice per run and round (the reference in two parts), at the given samples per second."""
    out = []
    rounds = len(next(iter(rates_by_run.values())))
    for r in range(rounds):
        for run, rates in rates_by_run.items():
            parts = rates[r] if isinstance(rates[r], tuple) else (rates[r],)
            for p, rate in enumerate(parts):
                n = samples // len(parts)
                cpu = (cpu_per_sample or {}).get(run, 1e-3) * n
                out.append({"round": r, "position": 0, "run": run, "part": p if len(parts) > 1 else None,
                            "first_step": 0, "end_step": 10, "samples": n, "wall_s": n / rate,
                            "cpu_s": {"worker": cpu / 2, "servers": cpu / 2, "coordinator": 0.0}})
    return out


def test_overhead_is_the_median_ratio_with_an_interval_of_the_median():
    rng = np.random.default_rng(1)
    base = 1000 * (1 + 0.1 * rng.standard_normal(20))  # the machine's speed varies round to round
    ref = [(b * (1 + 0.01 * rng.standard_normal()), b * (1 + 0.01 * rng.standard_normal())) for b in base]
    mine = list(base / 1.2 * (1 + 0.01 * rng.standard_normal(20)))
    s = slices({"reference": ref, "ecrec": mine}, {"reference": 1e-3, "ecrec": 1.5e-3})
    o = acc.overhead(s, "ecrec", seed=0)
    assert o["wall"]["median"] == pytest.approx(0.2, abs=0.02)
    assert o["wall"]["ci95_low"] < 0.2 < o["wall"]["ci95_high"] and o["wall"]["within_noise"] is False
    assert o["cpu"]["median"] == pytest.approx(0.5) and o["cpu"]["ci95_low"] == pytest.approx(0.5)
    assert len(o["wall"]["log_ratios"]) == 20
    aa = acc.aa_overhead(s)
    assert aa["wall"]["ci95_low"] <= 0.0 <= aa["wall"]["ci95_high"] and aa["wall"]["within_noise"] is True
    assert aa["cpu"]["median"] == pytest.approx(0.0, abs=1e-12)


def test_the_aa_interval_holds_zero_under_noise():
    held = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        ref = [tuple(1000 * (1 + 0.05 * rng.standard_normal(2))) for _ in range(20)]
        aa = acc.aa_overhead(slices({"reference": ref}))
        held += aa["wall"]["within_noise"]
    assert held >= 34  # a 95 % interval: about 38 of 40


def test_paired_difference_and_a_single_round():
    s = slices({"reference": [1000.0, 2000.0, 1500.0], "a": [1000 / 1.2, 2000 / 1.2, 1500 / 1.2],
                "b": [1000 / 1.1, 2000 / 1.1, 1500 / 1.1]})
    d = acc.paired_difference(s, "a", "b")
    assert d["median"] == pytest.approx(0.1) and d["within_noise"] is False
    one = acc.overhead(slices({"reference": [1000.0], "x": [500.0]}), "x")
    assert one["wall"]["median"] == pytest.approx(1.0) and one["wall"]["ci95_low"] is None
    assert one["wall"]["within_noise"] is None
    with pytest.raises(ValueError):
        acc.ratio_statistic([1.0], [0.0])


def test_load_warnings():
    loads = {"ecrec": {"before": [3.5, 1, 1], "after": [1.0, 1, 1]}, "none": {"before": [0.5, 0, 0], "after": [1.0, 0, 0]}}
    warnings = acc.load_warnings(loads, cores=2)
    assert len(warnings) == 1 and warnings[0].startswith("ecrec: load average 3.5 on 2 cores")


def test_the_rate_of_a_later_failure_starts_when_the_run_found_the_previous_one_over():
    """A standby starting up (compiling, on the same cores) slows the steps after the first failure; the
    run records when it found that failure over (``quiet_since``) and the rate starts there, so the slow
    steps do not lower it (which would turn every later step into a negative deficit)."""
    recs = records([0.1] * 30 + [0.5] + [0.1] * 10 + [0.3] * 20 + [0.1] * 40 + [0.4] + [0.1] * 20)
    kills = [{"time": recs[30]["start"]}, {"time": recs[101]["start"], "quiet_since": recs[61]["start"]}]
    events = [{"kind": "redundant", "index": 1, "wall_time": recs[120]["end"]}]  # a rebuild after the second
    _, second = acc.failure_accounts(recs, events, kills, "erasure")
    assert second["samples_per_s_before"] == pytest.approx(100.0) and second["rate_steps"] == 40
    assert second["lost_training_s"] == pytest.approx(0.3)
    assert second["quiet_since"] == recs[61]["start"]
    without = acc.failure_accounts(recs, events, [kills[0], {"time": kills[1]["time"]}], "erasure")[1]
    assert without["samples_per_s_before"] < 100.0 and without["deficit_s"] < -0.5  # 19 steps "faster" than 0.14 s


# --- memory and the expected cost per day --------------------------------------------------------------------
def test_memory_steady_and_peak_over_the_reference():
    ref = {"model_bytes": 1000, "memory": {"failure_free": {"rss_bytes": 5000, "peak_rss_bytes": 6000},
                                            "failures": {"rss_bytes": 5000, "peak_rss_bytes": 6500}}}
    full = {"model_bytes": 1000, "memory": {"failure_free": {"rss_bytes": 5100, "peak_rss_bytes": 8400}}}
    base, mine = acc.memory_figures(ref), acc.memory_figures(full)
    assert (base["memory_steady"], base["memory_peak"], base["memory_peak_failures"]) == (5.0, 6.0, 6.5)
    over = acc.memory_over_reference(mine, base)
    assert over["memory_steady_over_none"] == pytest.approx(0.1)
    assert over["memory_peak_over_none"] == pytest.approx(2.4)  # a save's temporaries: only in the peak
    assert over["memory_peak_failures_over_none"] is None  # not recorded for that run
    assert acc.memory_figures({"model_bytes": 0, "memory": {}})["memory_steady"] is None


def test_cost_per_day_of_a_strategy_without_an_interval():
    from ecrec.bench.cost import expected_cost

    row = {"strategy": "ecrec", "overhead_vs_none": 0.10, "overhead_spread": {"ci95_low": 0.05, "ci95_high": 0.2},
           "lost_training_s": 0.5, "lost_training_s_range": [0.4, 0.7], "replayed_s": 0.0, "failures": [{}, {}],
           "lost_updates": 0}
    c = expected_cost(row, 12 * 3600.0, model_bytes=10**9)
    assert c["failures_per_day"] == pytest.approx(2.0) and c["interval_ratio"] == 1.0
    assert c["overhead_s_per_day"] == pytest.approx(8640.0)
    assert c["failures_s_per_day"] == pytest.approx(1.0)
    assert c["cost_s_per_day"] == pytest.approx(8641.0) and c["cost_fraction"] == pytest.approx(8641.0 / 86400)
    assert c["cost_low_s"] == pytest.approx(4320.0 + 0.8) and c["cost_high_s"] == pytest.approx(17280.0 + 1.4)
    assert c["lost_updates_per_day"] == 0


def test_cost_per_day_of_full_moves_its_interval_to_the_mtbf_asked():
    """full ran at Daly's interval for a 10 s MTBF; at 24 h its saves are rarer (overhead / r) and a failure
    replays more (replayed x r), r from the same model with the same measured save stall."""
    from baselines import overhead
    from ecrec.bench.cost import expected_cost

    interval = {"how": "Daly", "formula": "daly", "o_save_s": 0.05, "mtbf_s": 10.0, "interval_s": 1.0}
    row = {"strategy": "full", "overhead_vs_none": 0.2, "lost_training_s": 1.5, "replayed_s": 0.6,
           "failures": [{}, {}, {}], "lost_updates": None, "interval": interval}
    c = expected_cost(row, 86400.0)
    r = overhead.daly_interval(0.05, 86400.0) / overhead.daly_interval(0.05, 10.0)
    assert r > 50 and c["interval_ratio"] == pytest.approx(r)
    assert c["overhead_s_per_day"] == pytest.approx(86400 * 0.2 / r)
    assert c["failures_s_per_day"] == pytest.approx(0.9 + 0.6 * r)
    assert c["interval_s"] == pytest.approx(r)
    # at the run's own MTBF every figure is the measured one
    same = expected_cost(row, 10.0)
    assert same["interval_ratio"] == pytest.approx(1.0)
    assert same["cost_s_per_day"] == pytest.approx(86400 * 0.2 + 8640 * 1.5)
    given = expected_cost(dict(row, interval={"how": "given", "interval_s": 1.0, "interval_steps": 10}), 86400.0)
    assert given["interval_ratio"] == 1.0 and given["overhead_s_per_day"] == pytest.approx(86400 * 0.2)


def test_cost_per_day_of_cpr_scales_its_pls_interval_and_lost_updates_with_the_mtbf():
    from ecrec.bench.cost import cost_table, expected_cost, format_cost_table

    interval = {"how": "PLS", "target_pls": 0.01, "servers": 4, "mtbf_s": 10.0, "interval_s": 0.8}
    cpr = {"strategy": "cpr", "overhead_vs_none": 0.05, "lost_training_s": 0.3, "replayed_s": 0.0,
           "failures": [{}, {}], "lost_updates": 400, "interval": interval}
    c = expected_cost(cpr, 3600.0)
    assert c["interval_ratio"] == pytest.approx(360.0)
    assert c["overhead_s_per_day"] == pytest.approx(86400 * 0.05 / 360)
    assert c["lost_updates_per_day"] == pytest.approx(24 * 200 * 360)
    none = {"strategy": "none", "overhead_vs_none": None, "lost_training_s": None}
    table = cost_table([none, cpr, {"strategy": "ecrec", "overhead_vs_none": 0.0001, "lost_training_s": 0.2}], 3600.0)
    assert [t["strategy"] for t in table] == ["ecrec", "cpr", "none"]  # cheapest first, no cost last
    text = format_cost_table(table)
    assert "MTBF of 1 h" in text and "24.00 failures/day" in text and text.count("\n") == 4
    with pytest.raises(ValueError, match="MTBF"):
        expected_cost(cpr, 0.0)
