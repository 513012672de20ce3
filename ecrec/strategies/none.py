"""Strategy ``none``: no fault tolerance. A replacement server starts from initial values."""

from __future__ import annotations

from ecrec.strategies.base import FaultToleranceStrategy


class NoFaultTolerance(FaultToleranceStrategy):
    name = "none"
    fills_in_bulk = True  # nothing beside the rows
