"""Finds fault-tolerance strategies by name through the ``ecrec.strategies`` entry points.

``pyproject.toml`` registers ``none`` (and the baselines register theirs); a
third-party package can add a strategy by declaring an entry point in the same group.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from ecrec.strategies.base import FaultToleranceStrategy

GROUP = "ecrec.strategies"


def available() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUP))


def get_strategy(name: str) -> type[FaultToleranceStrategy]:
    matches = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not matches:
        names = ", ".join(available()) or "none registered: is the package installed (pip install -e .)?"
        raise ValueError(f"unknown fault-tolerance strategy {name!r}; available: {names}")
    cls = matches[0].load()
    if not (isinstance(cls, type) and issubclass(cls, FaultToleranceStrategy)):
        raise TypeError(f"entry point {name!r} ({matches[0].value}) is not a FaultToleranceStrategy")
    return cls
