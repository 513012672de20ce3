"""Fault-tolerance strategies: the interface (``base``), the registry by name, and ``none``."""

from ecrec.strategies.base import Completion, FaultToleranceStrategy
from ecrec.strategies.registry import available, get_strategy

__all__ = ["Completion", "FaultToleranceStrategy", "available", "get_strategy"]
