"""The computations behind ``compare``'s fair failure figures, on hand-built step records: failure phases,
useful steps, back to speed, lost training time (paused + replayed + deficit), the useful timeline, and the
spread of paired overheads (``ecrec.bench.lost_training`` and ``ecrec.bench.spread``)."""

from __future__ import annotations

import pytest

from ecrec.bench import lost_training as lt
from ecrec.bench import spread


def records(durations, steps=None, samples=10, t0=0.0, rewind=None):
    """Step records back to back; ``rewind``: {record index: step the failure there rolled back to}."""
    out, t = [], t0
    steps = list(range(len(durations))) if steps is None else steps
    for i, (step, d) in enumerate(zip(steps, durations)):
        out.append({"step": step, "start": t, "end": t + d, "samples": samples,
                    "rewind_to": (rewind or {}).get(i)})
        t += d
    return out


# --- failure phases ---------------------------------------------------------------------------------
def test_failure_phases_are_midpoints_with_mean_one_half():
    assert lt.failure_phases(1) == [0.5]
    assert lt.failure_phases(3) == pytest.approx([1 / 6, 1 / 2, 5 / 6])
    assert sum(lt.failure_phases(4)) / 4 == pytest.approx(0.5)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_failure_phases_reject_bad_counts(bad):
    with pytest.raises(ValueError, match="integer >= 1"):
        lt.failure_phases(bad)


# --- useful progress --------------------------------------------------------------------------------
def full_recovery_records():
    """rate 100 samples/s; steps 0..7 take 0.1 s (t = 0..0.8); the kill at 0.8; step 8 stalls 0.5 s and is
    rolled back to the save at step 5; steps 5, 6, 7 are replayed, then 8 and 9 run at speed."""
    steps = [0, 1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    durations = [0.1] * 8 + [0.5] + [0.1] * 9
    return records(durations, steps, rewind={8: 5})


def test_useful_mask_skips_rolled_back_and_replayed_steps():
    mask = lt.useful_mask(full_recovery_records())
    assert mask.tolist() == [True] * 8 + [False, False, False, False] + [True] * 6


def test_lost_training_of_a_rollback():
    recs = full_recovery_records()
    assert lt.furthest_step_before(recs, 0.8) == 7
    back = lt.back_to_speed(recs, 0.8, 0.1)
    assert back == pytest.approx(1.7)  # the end of the second step 8: the first step past 7 after the kill
    cost = lt.failure_cost(recs, 0.8, back, rate=100.0)
    assert cost.paused_s == pytest.approx(0.5)  # the rolled-back step: kill -> rollback done
    assert cost.replayed_s == pytest.approx(0.3)  # steps 5, 6, 7 again
    assert cost.deficit_s == pytest.approx(0.0)
    assert cost.lost_training_s == pytest.approx(0.8)
    assert cost.window_s == pytest.approx(0.9)
    assert cost.useful_samples == 10
    # only the new step 8 counts: 10 samples in 0.9 s against 100 samples/s
    assert cost.useful_throughput_ratio == pytest.approx(10 / 0.9 / 100)
    assert cost.lost_training_s == pytest.approx(cost.window_s - cost.useful_samples / 100.0)


def rebuild_records():
    """The kill at 0.5; step 5 stalls (0.5 s), steps 6..9 are slowed by a rebuild (0.15 s), then 0.1 s again."""
    return records([0.1] * 5 + [0.5] + [0.15] * 4 + [0.1] * 6)


def test_lost_training_of_a_slow_rebuild_is_pause_plus_deficit():
    recs = rebuild_records()
    back = lt.back_to_speed(recs, 0.5, 0.1)
    # step 8 (ends 1.45) is the first whose median of it and the next 4 steps is back at 0.1 s
    assert back == pytest.approx(1.45)
    redundant = 1.5  # later than back to speed: the window runs to the end of the step under way then (1.6)
    cost = lt.failure_cost(recs, 0.5, max(back, redundant), rate=100.0)
    assert cost.window_s == pytest.approx(1.1)
    assert cost.paused_s == pytest.approx(0.4)  # the stalled step less one normal step
    assert cost.replayed_s == 0.0
    assert cost.deficit_s == pytest.approx(4 * 0.05)
    assert cost.lost_training_s == pytest.approx(0.6)
    assert cost.useful_throughput_ratio == pytest.approx(50 / 1.1 / 100)


def test_a_kill_inside_a_step_starts_the_window_at_that_step():
    recs = records([0.1] * 4 + [0.3] + [0.1] * 6)  # step 4 runs 0.4-0.7 and the kill falls at 0.45
    cost = lt.failure_cost(recs, 0.45, 0.7, rate=100.0)
    assert cost.window_s == pytest.approx(0.3)
    assert cost.paused_s == pytest.approx(0.2) and cost.lost_training_s == pytest.approx(0.2)


def test_no_failure_cost_costs_nothing():
    recs = records([0.1] * 10)
    cost = lt.failure_cost(recs, 0.3, 0.6, rate=100.0)
    assert cost.lost_training_s == pytest.approx(0.0, abs=1e-12)
    assert cost.useful_throughput_ratio == pytest.approx(1.0)


def test_failure_cost_rejects_bad_input():
    recs = records([0.1] * 5)
    with pytest.raises(ValueError, match="rate"):
        lt.failure_cost(recs, 0.1, 0.3, rate=0.0)
    with pytest.raises(ValueError, match="before the failure"):
        lt.failure_cost(recs, 0.3, 0.1, rate=100.0)
    with pytest.raises(ValueError, match="no step ends after"):
        lt.failure_cost(recs, 5.0, 6.0, rate=100.0)
    with pytest.raises(ValueError, match="median_step_s"):
        lt.back_to_speed(recs, 0.1, 0.0)


def test_never_back_to_speed():
    recs = records([0.1] * 5 + [0.3] * 10)
    assert lt.back_to_speed(recs, 0.5, 0.1) is None


def test_useful_timeline_shows_the_rollback_as_a_dip():
    # time 0 at 0.75 s, so that every step ends mid-bucket (buckets are labelled by their right edge)
    tl = lt.useful_timeline(full_recovery_records(), 0.75, before_s=0.4, after_s=1.2, bucket_s=0.1)
    rates = dict(zip([round(t, 3) for t in tl["t"]], tl["useful_samples_per_s"]))
    assert rates[0.1] == pytest.approx(100.0)  # step 7 ends at 0.05
    # the stalled step and the replays of 5, 6, 7 (ending 0.55 .. 0.85) add nothing
    assert all(rates[t] == 0.0 for t in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9))
    assert rates[1.0] == pytest.approx(100.0)  # the new step 8 ends at 0.95
    assert tl["bucket_s"] == 0.1


def test_mean_and_range():
    assert lt.mean_and_range([1.0, None, 3.0]) == {"mean": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    assert lt.mean_and_range([None]) is None


# --- spread of paired overheads --------------------------------------------------------------------------
def test_overhead_spread_and_noise():
    clear = spread.overhead_spread([100.0, 110.0, 90.0], [50.0, 55.0, 45.0])  # +100 % every round
    assert clear.median == pytest.approx(1.0) and clear.ci95_low == pytest.approx(1.0)
    assert clear.within_noise is False
    noisy = spread.overhead_spread([100.0, 100.0, 100.0], [100 / 1.1, 100 / 0.9, 100.0])  # +10 %, -10 %, 0
    assert noisy.mean == pytest.approx(0.0, abs=1e-12)
    assert (noisy.low, noisy.high) == pytest.approx((-0.1, 0.1))
    # half width t(2) * sd / sqrt(3) = 4.303 * 0.1 / sqrt(3)
    assert noisy.ci95_high == pytest.approx(4.303 * 0.1 / 3 ** 0.5)
    assert noisy.within_noise is True
    assert spread.overhead_spread([100.0], [50.0]).within_noise is None  # one round: no interval


def test_difference_spread_is_paired_per_round():
    ref = [100.0, 200.0, 150.0]  # the machine's speed changes from round to round
    a = [r / 1.2 for r in ref]  # +20 % every round
    b = [r / 1.1 for r in ref]  # +10 % every round
    d = spread.difference_spread(ref, a, b)
    assert d.mean == pytest.approx(0.1) and d.within_noise is False


def test_spread_rejects_bad_input():
    with pytest.raises(ValueError):
        spread.spread([])
    with pytest.raises(ValueError):
        spread.paired_overheads([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        spread.paired_overheads([1.0], [0.0])
    with pytest.raises(ValueError):
        spread.t_quantile_975(0)


# --- the checkpoint timers a benchmark pauses outside a strategy's own slices ----------------------------------
class _IdleHost:
    """The least of a server a checkpointing strategy's timers and ``timers`` command touch: no tables."""

    index = 0

    def tables(self):
        return []

    def dense_tensors(self):
        return []


def test_paused_timers_neither_save_nor_lose_their_phase(tmp_path):
    from baselines.cpr import PartialRecovery

    strategy = PartialRecovery(_IdleHost(), PartialRecovery.options_from({"dir": str(tmp_path), "interval_s": "10"}))
    strategy.on_timer()  # the first tick starts the cycle: a full save due in 10 s
    paused = strategy.call("timers", {"paused": True})
    assert paused["paused"] is True and 0.0 < paused["next_full_in_s"] <= 10.0
    strategy._next_full_at -= 20.0  # the save is overdue ...
    strategy.on_timer()
    assert strategy.stats()["saves"] == 0  # ... but paused timers do not save
    strategy._next_full_at += 20.0
    strategy._paused_at -= 5.0  # as if 5 s went by while paused
    resumed = strategy.call("timers", {"paused": False})
    assert resumed["paused"] is False
    # the time spent paused does not count: still about the same time to the next save, not 5 s less
    assert resumed["next_full_in_s"] > paused["next_full_in_s"] - 4.0
    with pytest.raises(ValueError, match="paused must be true or false"):
        strategy.call("timers", {"paused": "yes"})
    with pytest.raises(ValueError, match="unknown arguments"):
        strategy.call("timers", {"pause": True})
    assert strategy.stats()["redundancy_bytes"] == 0  # no table: no per-row counters yet


@pytest.mark.parametrize("seed", [0, 1, 7, 123])
def test_seeded_failure_phases_fall_one_per_part_and_off_the_partial_save_grid(seed):
    phases = lt.failure_phases(3, seed=seed, avoid=4, margin=0.02)
    assert phases == lt.failure_phases(3, seed=seed, avoid=4, margin=0.02)  # the seed decides
    for i, x in enumerate(phases):
        assert i / 3 <= x < (i + 1) / 3  # stratified: one per third of the interval
        assert min(abs(x - g / 4) for g in range(5)) >= 0.02 - 1e-12  # never at a partial save (every 1/4)
    assert sum(phases) / 3 == pytest.approx(0.5)  # mirrored pairs: a cost linear in the phase is unbiased
    assert lt.failure_phases(3, seed=seed) != lt.failure_phases(3)  # not the midpoints 1/6, 1/2, 5/6
    assert lt.failure_phases(3, seed=seed + 1, avoid=4) != phases


def test_seeded_failure_phases_reject_a_margin_that_leaves_no_room():
    with pytest.raises(ValueError, match="margin"):
        lt.failure_phases(3, seed=0, avoid=4, margin=-1)
    with pytest.raises(ValueError, match="margin"):
        lt.failure_phases(3, seed=0, avoid=4, margin=float("nan"))
    assert sum(lt.failure_phases(4, seed=3, avoid=4)) / 4 == pytest.approx(0.5)
