"""Pacing a replacement's background rebuild by what training does, not by OS priority alone.

While an index rebuilds, training goes on and its steps share the machines with the rebuild.  The replacement
sees training's rate directly: the pushes that reach it (every step of every worker touching its rows).  The
pacer compares that rate while the background rebuild works with the rate while it rests, and sets the share
of time the rebuild may work (its *duty*) so that training runs at no less than ``1 / (1 + slowdown)`` of its
rate at rest -- ``slowdown`` the ``rebuild_slowdown`` option.  The reference rate is measured in short
*probes* (the rebuild rests a moment), at the start and every ``probe_every_s``, so it follows training as it
changes (a new worker, a bigger batch).  The duty moves by the ratio of the slowdown allowed to the slowdown
seen, at most doubling or halving per step, never below ``min_duty``: redundancy always comes back.

A sans-I/O state machine: no clock, thread or socket of its own.  The rebuild engine
(:mod:`~ecrec.strategies.erasure.rebuild`) feeds it pushes and worked time and sleeps what it answers; the
tests drive it with a simulated training.
"""

from __future__ import annotations

from dataclasses import dataclass

#: a window counts once it spans this long and this many pushes (a rate from fewer is noise)
MIN_WINDOW_S = 0.25
MIN_WINDOW_PUSHES = 8
#: a probe rests at most this long, even when too few pushes come (training slowed or stopped)
MAX_PROBE_S = 1.0


@dataclass
class PacerState:
    """What the pacer reports (``ecrec-server`` stats and the recovery benchmark)."""

    duty: float
    reference_rate: float  # pushes per second while the rebuild rests (0: not measured yet)
    loaded_rate: float  # pushes per second while it works at the last adjustment (0: none yet)
    probes: int
    adjustments: int


class RebuildPacer:
    """The duty of a background rebuild that keeps training within ``1 + slowdown`` of its rate at rest."""

    def __init__(self, slowdown: float, min_duty: float = 0.02, probe_every_s: float = 3.0,
                 initial_duty: float = 0.25):
        if slowdown <= 0:
            raise ValueError(f"rebuild pacing: slowdown must be > 0 (got {slowdown})")
        if not 0 < min_duty <= initial_duty <= 1:
            raise ValueError(f"rebuild pacing: need 0 < min_duty <= initial_duty <= 1 (got {min_duty}, {initial_duty})")
        self.slowdown = slowdown
        self.min_duty = min_duty
        self.probe_every_s = probe_every_s
        self.duty = initial_duty
        self.max_duty = 1.0  # the most it may work (the engine sets it from rebuild_duty)
        self.reference_rate = 0.0
        self.loaded_rate = 0.0
        self.probes = 0
        self.adjustments = 0
        self._pushes = 0  # pushes seen, ever
        self._probe_until: float | None = None  # resting to measure the reference until then (None: not probing)
        self._probe_start = (0.0, 0)  # (time, pushes) when the probe began
        self._next_probe = 0.0  # when the next probe is due (0: at the first call)
        self._window = (0.0, 0)  # (time, pushes) when the current loaded window began

    def on_push(self) -> None:
        """A push reached this server (call on every push while the rebuild runs)."""
        self._pushes += 1

    def rest_after(self, now: float, worked_s: float) -> float:
        """Seconds the rebuild rests after ``worked_s`` of work ending at ``now`` (a probe is a longer rest)."""
        if self._probe_until is not None:  # a probe the caller stopped resting for (training paused): go on with it
            more = self.after_rest(now)
            if more > 0:
                return more
        if self._probe_until is None and now >= self._next_probe:
            self._start_probe(now)
            return self._probe_until - now
        self._adjust(now)
        return worked_s * (1.0 / min(self.duty, self.max_duty) - 1.0)

    def after_rest(self, now: float) -> float:
        """Called when a rest ends: seconds more to rest (a probe not long enough yet), else 0."""
        if self._probe_until is None:
            return 0.0
        t0, p0 = self._probe_start
        pushes, span = self._pushes - p0, now - t0
        if (span >= MIN_WINDOW_S and pushes >= MIN_WINDOW_PUSHES) or span >= MAX_PROBE_S:
            if pushes >= MIN_WINDOW_PUSHES:  # too few: keep the previous reference
                self.reference_rate = pushes / span
            self._probe_until = None
            self._next_probe = now + self.probe_every_s
            self._window = (now, self._pushes)
            self.probes += 1
            return 0.0
        self._probe_until = max(self._probe_until, now + MIN_WINDOW_S / 4)
        return self._probe_until - now

    def state(self) -> PacerState:
        return PacerState(self.duty, self.reference_rate, self.loaded_rate, self.probes, self.adjustments)

    # --- inside ------------------------------------------------------------------------------------------------
    def _start_probe(self, now: float) -> None:
        self._probe_start = (now, self._pushes)
        self._probe_until = now + MIN_WINDOW_S

    def _adjust(self, now: float) -> None:
        t0, p0 = self._window
        pushes, span = self._pushes - p0, now - t0
        if span < MIN_WINDOW_S or pushes < MIN_WINDOW_PUSHES or self.reference_rate <= 0:
            return
        self.loaded_rate = pushes / span
        seen = self.reference_rate / self.loaded_rate - 1.0  # how much slower training ran while working
        factor = 2.0 if seen <= 0 else min(2.0, max(0.5, self.slowdown / seen))
        self.duty = min(1.0, self.max_duty, max(self.min_duty, self.duty * factor))
        self._window = (now, self._pushes)
        self.adjustments += 1
