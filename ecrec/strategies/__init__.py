"""Fault-tolerance strategies: the interface (``base``), light specs found by name (``spec``,
``registry``), ``none``, and the erasure-coding strategy (``erasure``)."""

from ecrec.strategies.registry import available, get_spec, names_of_kind, ordered
from ecrec.strategies.spec import StrategySpec

__all__ = ["StrategySpec", "available", "get_spec", "names_of_kind", "ordered"]
