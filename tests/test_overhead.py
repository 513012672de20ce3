"""The CPR overhead model (``baselines.overhead``) against values computed by hand."""

from __future__ import annotations

import math

import pytest

from baselines import overhead


def test_young_interval():
    # sqrt(2 * 2 s * 3600 s) = sqrt(14400) = 120 s
    assert overhead.young_interval(2.0, 3600.0) == pytest.approx(120.0)
    # sqrt(2 * 30 s * 14 h) = sqrt(3_024_000) = 1738.96 s
    assert overhead.young_interval(30.0, 14 * 3600.0) == pytest.approx(1738.965, abs=1e-3)


def test_daly_interval():
    # d = 2, M = 3600: x = d/2M = 1/3600, sqrt(x) = 1/60
    # 120 * (1 + 1/180 + 1/32400) - 2 = 120 + 0.666667 + 0.003704 - 2 = 118.670370
    assert overhead.daly_interval(2.0, 3600.0) == pytest.approx(118.670370, abs=1e-6)
    # d >= 2M: the interval is M
    assert overhead.daly_interval(10.0, 4.0) == 4.0
    assert overhead.optimal_full_interval(2.0, 3600.0, "young") == pytest.approx(120.0)
    with pytest.raises(ValueError, match="formula"):
        overhead.optimal_full_interval(2.0, 3600.0, "magic")


def test_full_and_partial_overhead():
    # O_full = 2/120 + (1/3600) * (10 + 0 + 60) = 0.0166667 + 0.0194444 = 0.0361111
    assert overhead.full_overhead(120.0, 2.0, 10.0, 3600.0) == pytest.approx(0.0361111, abs=1e-7)
    # with o_res = 5 s and t_total = 36000 s: 2*300 + 10*(10+5+60) = 600 + 750 = 1350 s
    assert overhead.full_overhead(120.0, 2.0, 10.0, 3600.0, o_res=5.0, t_total=36000.0) == pytest.approx(1350.0)
    # O_partial = 2/288 + 10/3600 = 0.0069444 + 0.0027778 = 0.0097222
    assert overhead.partial_overhead(288.0, 2.0, 10.0, 3600.0) == pytest.approx(0.0097222, abs=1e-7)


def test_young_minimises_full_overhead():
    t = overhead.young_interval(2.0, 3600.0)
    best = overhead.full_overhead(t, 2.0, 10.0, 3600.0)
    for f in (0.5, 0.8, 1.25, 2.0):
        assert overhead.full_overhead(t * f, 2.0, 10.0, 3600.0) > best


def test_pls_and_interval():
    # T = 2 * 0.01 * 4 * 3600 = 288 s; PLS(288) = 288 / (2*4*3600) = 0.01
    assert overhead.interval_for_pls(0.01, 4, 3600.0) == pytest.approx(288.0)
    assert overhead.expected_pls(288.0, 4, 3600.0) == pytest.approx(0.01)
    assert overhead.pls(5, 200) == 0.025
    assert overhead.pls(0, 0) == 0.0
    for bad in (0.0, 1.0, -0.1, math.nan):
        with pytest.raises(ValueError, match="target_pls"):
            overhead.interval_for_pls(bad, 4, 3600.0)
    with pytest.raises(ValueError, match="n_emb"):
        overhead.expected_pls(10.0, 0, 3600.0)
    with pytest.raises(ValueError, match="mtbf"):
        overhead.young_interval(1.0, 0.0)


def test_plan_chooses_partial_when_cheaper():
    plan = overhead.plan_recovery(o_save=2.0, o_load=10.0, mtbf=3600.0, n_emb=4, target_pls=0.01, formula="young")
    assert plan.recovery == "partial"
    assert plan.interval_s == pytest.approx(288.0)
    assert plan.full_interval_s == pytest.approx(120.0)
    assert plan.full_overhead == pytest.approx(0.0361111, abs=1e-7)
    assert plan.partial_overhead == pytest.approx(0.0097222, abs=1e-7)
    assert plan.expected_pls == pytest.approx(0.01)


def test_plan_falls_back_to_full_for_tiny_pls_targets():
    # target 1e-4: T = 2.88 s; O_partial = 2/2.88 + 10/3600 = 0.69722 > O_full(120 s) = 0.03611
    plan = overhead.plan_recovery(o_save=2.0, o_load=10.0, mtbf=3600.0, n_emb=4, target_pls=1e-4, formula="young")
    assert plan.recovery == "full"
    assert plan.interval_s == pytest.approx(120.0)
    assert plan.partial_interval_s == pytest.approx(2.88)
    assert plan.partial_overhead == pytest.approx(2 / 2.88 + 10 / 3600)
    assert plan.expected_pls == 0.0


def test_the_persist_time_bounds_the_interval_and_adds_to_the_lost_work():
    """A save stalls training for o_save but is on disk only o_persist later: the interval never falls below
    the persist time, and a failure loses T/2 + o_persist of work on average."""
    t = overhead.optimal_full_interval(0.001, 10.0)  # about 0.14 s from the stall alone
    assert overhead.optimal_full_interval(0.001, 10.0, persist_s=0.43) == 0.43 > t
    assert overhead.optimal_full_interval(0.001, 10.0, persist_s=0.01) == t
    base = overhead.full_overhead(1.0, 0.01, 0.1, 10.0)
    assert overhead.full_overhead(1.0, 0.01, 0.1, 10.0, persist_s=0.4) == pytest.approx(base + 0.4 / 10.0)
    plan = overhead.plan_recovery(0.001, 0.05, 10.0, 4, 1e-4, persist_s=0.43)
    assert plan.full_interval_s == 0.43 and plan.partial_interval_s == 0.43
    with pytest.raises(ValueError, match="persist_s"):
        overhead.optimal_full_interval(0.01, 10.0, persist_s=-1)


def test_the_realistic_preset_leaves_cpr_room():
    """``compare --preset realistic``: cpr's PLS interval is 10x or more full's Daly interval for every save
    stall up to 100 ms and persist time up to 1 s (quick's measured: tens of ms and 0.1-0.4 s)."""
    from ecrec.bench.compare import PRESETS

    p = PRESETS["realistic"]
    t_cpr = overhead.interval_for_pls(p["target_pls"], p["servers"], p["mtbf_s"])
    for o_save in (0.005, 0.04, 0.1):
        for persist in (0.0, 0.43, 1.0):
            assert t_cpr >= 10 * overhead.optimal_full_interval(o_save, p["mtbf_s"], "daly", persist)
    assert PRESETS["quick"]["mtbf_s"] < p["mtbf_s"]
