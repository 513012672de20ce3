"""Finds strategies by name: the ``ecrec.strategies`` entry points, each a light :class:`StrategySpec`.

``pyproject.toml`` registers ``none`` and ``ecrec`` (and the baselines register theirs); a
third-party package adds a strategy by declaring an entry point in the same group that names its
spec.  Nothing here imports a server-side strategy class.
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points

from ecrec.strategies.spec import StrategySpec

GROUP = "ecrec.strategies"


def available() -> list[str]:
    """Names of the installed strategies, sorted."""
    return sorted(ep.name for ep in entry_points(group=GROUP))


@functools.lru_cache(maxsize=None)
def get_spec(name: str) -> StrategySpec:
    """The spec registered under ``name``; ValueError naming the installed ones when there is none."""
    matches = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not matches:
        names = ", ".join(available()) or "none registered: is the package installed (pip install -e .)?"
        raise ValueError(f"unknown fault-tolerance strategy {name!r}; available: {names}")
    spec = matches[0].load()
    if not isinstance(spec, StrategySpec):
        raise TypeError(f"entry point {name!r} ({matches[0].value}) is not a StrategySpec")
    if spec.name != name:
        raise TypeError(f"entry point {name!r} ({matches[0].value}) describes strategy {spec.name!r}")
    return spec


def ordered() -> list[str]:
    """Installed strategies in report order (each spec's ``rank``, then name)."""
    return sorted(available(), key=lambda name: (get_spec(name).rank, name))


def names_of_kind(kind: str) -> list[str]:
    """Installed strategies of one kind (``none``, ``erasure``, ``checkpoint``), in report order."""
    return [name for name in ordered() if get_spec(name).kind == kind]


def cluster_error(strategy: str, servers: int, k: int, m: int, options: dict[str, str]) -> str | None:
    """What a coordinator would refuse in a cluster of this shape and these options (None: nothing): the same
    checks (:class:`ecrec.config.ClusterSpec`, the strategy's ``layout_params``), for a command that starts
    clusters to say before any process starts."""
    from ecrec.config import ClusterSpec

    try:
        ClusterSpec(num_servers=servers, strategy=strategy, k=k, m=m, strategy_options=dict(options))
        get_spec(strategy).layout_params(servers, k, m, dict(options))
    except ValueError as exc:
        return str(exc)
    return None
