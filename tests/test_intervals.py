"""The intervals ``compare`` chooses (``ecrec.bench.intervals``), on hand-built updates: Daly in steps,
the replay of unsaved updates under each save policy, and the equal-PLS tuning of cpr-mfu / cpr-ssu."""

from __future__ import annotations

import numpy as np
import pytest

from baselines import overhead
from ecrec.bench import intervals
from ecrec.coding.layout import Layout


def hot_and_cold(steps: int = 4) -> intervals.ShardUpdates:
    """One table of 4 rows; every step updates row 0 (hot) and one of rows 1..3 in turn."""
    return intervals.ShardUpdates(tuple(np.array([0, 1 + s % 3]) for s in range(steps)), (0, 4), (4,))


def test_full_interval_steps_is_daly_in_steps():
    steps, seconds = intervals.full_interval_steps(0.012, 10.7, 0.011)
    assert seconds == pytest.approx(overhead.daly_interval(0.012, 10.7))
    assert steps == round(seconds / 0.011)
    assert intervals.full_interval_steps(1e-6, 1.0, 10.0)[0] == 1  # never below one step
    with pytest.raises(ValueError, match="step_s"):
        intervals.full_interval_steps(0.01, 10.0, 0.0)


def test_unsaved_updates_of_plain_cpr_by_hand():
    # full save every 4 steps: after steps 1, 2, 3 of a cycle 2, 4, 6 updates are unsaved, 0 after step 4
    assert intervals.mean_unsaved_updates(hot_and_cold(), 4, "cpr") == pytest.approx(3.0)


def test_mfu_partial_saves_keep_the_hot_row_fresh():
    # a partial save every 2 steps writes the most updated row (row 0, 2 of its updates unsaved):
    # unsaved after steps 1..4 of a cycle: 2, 4 - 2 = 2, 4, 0 -> mean 2 (cpr: 3)
    got = intervals.mean_unsaved_updates(hot_and_cold(), 4, "cpr-mfu", partials_per_interval=2, mfu_fraction=0.25)
    assert got == pytest.approx(2.0)


def test_ssu_with_a_sample_of_everything_saves_every_updated_row():
    # a sample as large as the events saves every updated row at each partial save: 2, 0 (saved), 2, 0
    got = intervals.mean_unsaved_updates(hot_and_cold(), 4, "cpr-ssu", partials_per_interval=2, ssu_sample=100)
    assert got == pytest.approx(1.0)


def test_unsaved_updates_reject_bad_input():
    with pytest.raises(ValueError, match="policy"):
        intervals.mean_unsaved_updates(hot_and_cold(), 4, "full")
    with pytest.raises(ValueError, match="interval_steps"):
        intervals.mean_unsaved_updates(hot_and_cold(), 0, "cpr")
    with pytest.raises(ValueError, match="partials_per_interval"):
        intervals.mean_unsaved_updates(hot_and_cold(), 4, "cpr-mfu", partials_per_interval=0)
    with pytest.raises(ValueError, match="no steps"):
        intervals.ShardUpdates((), (0, 4), (4,))


def test_equal_pls_tuning_lengthens_the_variants_to_cprs_pls():
    updates = hot_and_cold(steps=12)
    target, servers, mtbf, step_s = 0.01, 4, 100.0, 0.1
    t_cpr = overhead.interval_for_pls(target, servers, mtbf)  # 8 s = 80 steps
    tuned = intervals.equal_pls_intervals(target, servers, mtbf, step_s, updates, ["cpr", "cpr-mfu", "cpr-ssu"],
                                          partials_per_interval=4, mfu_fraction=0.25, ssu_sample=1000)
    assert tuned["cpr"].interval_s == pytest.approx(t_cpr) and tuned["cpr"].lost_ratio == 1.0
    for name in ("cpr-mfu", "cpr-ssu"):
        t = tuned[name]
        assert t.lost_ratio < 1.0  # its partial saves leave fewer updates unsaved at a given interval ...
        assert t.interval_s == pytest.approx(t_cpr / t.lost_ratio)  # ... so it may save less often
        assert t.partial_interval_s == pytest.approx(t.interval_s / 4)
        assert t.expected_pls == pytest.approx(target)  # at cpr's PLS
        # the ratio is the replay's at the tuned interval's previous iterate: check it is a fixed point nearby
        n = t.interval_s / step_s
        plain = intervals.mean_unsaved_updates(updates, n, "cpr")
        mine = intervals.mean_unsaved_updates(updates, n, name, partials_per_interval=4, mfu_fraction=0.25,
                                              ssu_sample=1000)
        assert mine / plain == pytest.approx(t.lost_ratio, rel=0.1)


def test_equal_pls_rejects_bad_input():
    with pytest.raises(ValueError, match="covers"):
        intervals.equal_pls_intervals(0.01, 4, 100.0, 0.1, hot_and_cold(), ["full"])
    with pytest.raises(ValueError, match="needs the run's updates"):
        intervals.equal_pls_intervals(0.01, 4, 100.0, 0.1, None, ["cpr-mfu"])
    with pytest.raises(ValueError, match="step_s"):
        intervals.equal_pls_intervals(0.01, 4, 100.0, 0.0, hot_and_cold(), ["cpr"])


def test_shard_updates_keeps_only_the_servers_rows():
    layout = Layout(4, 4, 0)  # checkpointing: rows over every server, no parity
    rows = [100, 50]
    step_ids = [[np.array([0, 1, 2, 3, 3]), np.array([5, 6])]]
    u = intervals.shard_updates(step_ids, rows, layout, server=1)
    where0, slots0 = layout.locate(np.array([0, 1, 2, 3]))
    where1, slots1 = layout.locate(np.array([5, 6]))
    expected = np.concatenate([slots0[where0 == 1], slots1[where1 == 1] + layout.data_slots_per_server(100)])
    assert sorted(u.steps[0].tolist()) == sorted(expected.tolist())
    assert u.table_offsets == (0, layout.data_slots_per_server(100),
                               layout.data_slots_per_server(100) + layout.data_slots_per_server(50))
    with pytest.raises(ValueError, match="outside"):
        intervals.shard_updates([[np.array([100]), np.array([0])]], rows, layout, server=1)


def test_a_sample_weighted_replay_counts_each_update_by_its_lookups():
    """Two slots: slot 0 is updated every step and looked up 3 times a step, slot 1 once a step once.  Weighted,
    the unsaved count of a step boundary is the lookups since the last save; MFU keeping slot 0 saved leaves a
    smaller share of the samples unsaved than of the row updates (a hot row's update carries more samples)."""
    steps = tuple(np.array([0, 1]) for _ in range(8))
    samples = tuple(np.array([3, 1]) for _ in range(8))
    u = intervals.ShardUpdates(steps, (0, 2), (2,), samples)
    assert intervals.mean_unsaved_updates(u, 4, "cpr", min_intervals=2) == pytest.approx(2 * (1 + 2 + 3 + 0) / 4)
    assert intervals.mean_unsaved_updates(u, 4, "cpr", min_intervals=2, weighted=True) == pytest.approx(
        4 * (1 + 2 + 3 + 0) / 4)
    kw = dict(partials_per_interval=4, mfu_fraction=0.5, min_intervals=2)
    by_updates = intervals.mean_unsaved_updates(u, 4, "cpr-mfu", **kw) / intervals.mean_unsaved_updates(u, 4, "cpr", **kw)
    by_samples = intervals.mean_unsaved_updates(u, 4, "cpr-mfu", weighted=True, **kw) / intervals.mean_unsaved_updates(
        u, 4, "cpr", weighted=True, **kw)
    assert by_samples <= by_updates
    with pytest.raises(ValueError, match="sample counts"):
        intervals.mean_unsaved_updates(intervals.ShardUpdates(steps, (0, 2), (2,)), 4, "cpr", weighted=True)
    with pytest.raises(ValueError, match="one count per slot"):
        intervals.ShardUpdates(steps, (0, 2), (2,), samples[:3])


def test_the_interval_in_steps_never_falls_below_the_persist_time():
    # Daly's 0.14 s and the persist floor 0.43 s: 0.43 / 0.1 rounds to 4 steps (0.40 s), so 5 are needed
    steps, seconds = intervals.full_interval_steps(0.001, 10.0, 0.1, persist_s=0.43)
    assert seconds == 0.43 and steps == 5 and steps * 0.1 >= 0.43
    assert intervals.full_interval_steps(0.001, 10.0, 0.3, persist_s=0.43)[0] == 2
