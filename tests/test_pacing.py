"""The rebuild's pacer (``ecrec.strategies.erasure.pacing``) against a simulated training whose steps slow down
while the rebuild works: it keeps training within the bound it is given, does not starve the rebuild, and
follows training when its rate changes."""

from __future__ import annotations

import pytest

from ecrec.strategies.erasure.options import parse
from ecrec.strategies.erasure.pacing import RebuildPacer


class Training:
    """Steps of ``base_s`` at rest, ``base_s * (1 + cost)`` while the rebuild works; a push per step."""

    def __init__(self, base_s: float, cost: float):
        self.base_s, self.cost = base_s, cost
        self.progress = 0.0  # steps, fractional
        self.pushed = 0

    def run(self, seconds: float, working: bool, pacer: RebuildPacer) -> None:
        self.progress += seconds / (self.base_s * (1 + self.cost) if working else self.base_s)
        while self.pushed < int(self.progress):
            self.pushed += 1
            pacer.on_push()


def simulate(pacer: RebuildPacer, training: Training, seconds: float, batch_s: float = 0.02,
             change_at: float | None = None, new_base_s: float = 0.0):
    """Runs the rebuild (batches of ``batch_s``) beside ``training`` for ``seconds``; returns, per second of the
    last half, (steps done, time working)."""
    now, worked, steps_at = 0.0, 0.0, {}
    while now < seconds:
        if change_at is not None and now >= change_at:
            training.base_s, change_at = new_base_s, None
        training.run(batch_s, True, pacer)
        now += batch_s
        worked += batch_s if now > seconds / 2 else 0.0
        rest = pacer.rest_after(now, batch_s)
        while rest > 0:
            training.run(rest, False, pacer)
            now += rest
            rest = pacer.after_rest(now)
        steps_at.setdefault(int(now), training.progress)
    half = int(seconds / 2)
    steps = training.progress - steps_at[min(t for t in steps_at if t >= half)]
    return steps, worked


@pytest.mark.parametrize("cost", [0.3, 1.0, 4.0])
@pytest.mark.parametrize("slowdown", [0.05, 0.1, 0.25])
def test_training_keeps_to_the_bound_and_the_rebuild_gets_what_is_left(cost, slowdown):
    base_s, seconds = 0.01, 60.0
    pacer = RebuildPacer(slowdown)
    training = Training(base_s, cost)
    steps, worked = simulate(pacer, training, seconds)
    span = seconds - int(seconds / 2)
    rate_ratio = steps * base_s / span  # training's rate over its rate at rest
    assert rate_ratio >= 1 / (1 + slowdown) - 0.03, (rate_ratio, pacer.state())
    # the duty that exactly meets the bound (probes aside): cost * duty / (1 + cost * duty) ... solved for duty
    ideal = min(1.0, slowdown / cost)
    assert worked / span >= 0.6 * ideal * (1 - 0.1), (worked / span, ideal, pacer.state())
    assert pacer.state().probes >= 10 and pacer.state().adjustments > 10


def test_a_cheap_rebuild_works_all_the_time():
    pacer = RebuildPacer(0.1)
    steps, worked = simulate(pacer, Training(0.01, 0.01), 30.0)
    assert pacer.duty == 1.0 and worked / 15.0 > 0.85


def test_the_pacer_follows_training_when_its_rate_changes():
    """Training's steps get four times longer halfway (another workload): the reference is probed again and the
    bound still holds against the new rate."""
    pacer = RebuildPacer(0.1)
    training = Training(0.005, 1.0)
    steps, _ = simulate(pacer, training, 60.0, change_at=20.0, new_base_s=0.02)
    assert steps * 0.02 / 30.0 >= 1 / 1.1 - 0.03
    assert abs(pacer.reference_rate - 50.0) < 5.0


def test_without_pushes_a_probe_ends_and_the_duty_stays():
    pacer = RebuildPacer(0.1)
    assert pacer.rest_after(0.0, 0.02) > 0  # the first call probes
    now = 0.0
    rest = pacer.rest_after(now, 0.0)
    while rest > 0:
        now += rest
        rest = pacer.after_rest(now)
    assert now <= 1.1 and pacer.reference_rate == 0.0 and pacer.duty == 0.25
    assert pacer.rest_after(now, 0.02) == pytest.approx(0.06)  # no reference: the initial duty


@pytest.mark.parametrize("value,match", [("-0.1", "rebuild_slowdown must be >= 0"), ("x", "rebuild_slowdown")])
def test_the_option_is_checked(value, match):
    with pytest.raises(ValueError, match=match):
        parse({"rebuild_slowdown": value}).validate()
    assert parse({"rebuild_slowdown": "0.1"}).validate().rebuild_slowdown == 0.1
    with pytest.raises(ValueError, match="slowdown must be > 0"):
        RebuildPacer(0.0)


def test_a_probe_cut_short_goes_on_at_the_next_call():
    """The engine stops resting when training stops; a probe it left ends at the next call (it used to stay open
    for good, answering no rest, and the rebuild then never rested again)."""
    pacer = RebuildPacer(0.1)
    assert pacer.rest_after(0.0, 0.02) > 0  # a probe
    for _ in range(20):
        pacer.on_push()
    rest = pacer.rest_after(0.3, 0.02)  # the caller came back after the probe's time without ending it
    assert pacer.probes == 1 and pacer.reference_rate == pytest.approx(20 / 0.3)
    assert rest == pytest.approx(0.02 * (1 / 0.25 - 1))  # and rests by its duty again


def test_the_duty_never_passes_the_cap_the_engine_sets():
    pacer = RebuildPacer(0.1)
    pacer.max_duty = 0.5  # rebuild_duty=0.5
    simulate(pacer, Training(0.01, 0.01), 30.0)
    assert pacer.duty <= 0.5
    assert pacer.rest_after(100.0, 0.02) >= 0.02 - 1e-9  # work at most half the time
