"""Light descriptions of strategies: name, kind, typed options, and where the server-side class lives.

The ``ecrec.strategies`` entry points resolve to :class:`StrategySpec` objects, so the
coordinator (which validates options and derives the layout), the checkpoint driver and the
benchmarks learn everything they need about a strategy without importing its server-side class;
only an embedding server calls :meth:`StrategySpec.load_class`.

Options travel in the cluster map as ``KEY=VALUE`` strings.  Each strategy declares them once, as a
dataclass of :func:`ecrec.config.option` fields (type, default, help); :func:`parse_options` turns
strings into that dataclass, refusing unknown keys and values of the wrong type by name, and then
runs the dataclass's own ``validate()`` for rules between fields.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

KINDS = ("none", "erasure", "checkpoint")


@dataclass(frozen=True)
class StrategySpec:
    """What every process may know about a strategy (see the module docstring)."""

    name: str
    kind: Literal["none", "erasure", "checkpoint"]
    summary: str
    #: dataclass of typed options (None: the strategy takes none)
    options_type: type | None
    #: ``module:Class`` of the server-side strategy, imported only by embedding servers
    server_class: str
    #: ``(num_servers, k, m, options) -> (k, m, normalized options as strings)``; raises ValueError
    layout: Callable[[int, int, int, Mapping[str, str]], tuple[int, int, dict[str, str]]] | None = None
    #: ``(options as strings) -> typed options``; default :func:`parse_options` on ``options_type``
    parser: Callable[[Mapping[str, str]], Any] | None = None
    #: position in reports (lower first); ties by name
    rank: int = 100

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"strategy {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def keeps_parity(self) -> bool:
        return self.kind == "erasure"

    @property
    def checkpoints(self) -> bool:
        return self.kind == "checkpoint"

    def parse_options(self, options: Mapping[str, str]) -> Any:
        """Typed, validated options from their strings (ValueError naming the bad option)."""
        if self.parser is not None:
            return self.parser(options)
        return parse_options(self.name, self.options_type, options)

    def layout_params(self, num_servers: int, k: int, m: int, options: Mapping[str, str]) -> tuple[int, int, dict]:
        """Validates the user's ``k``, ``m`` and options; returns the layout's ``(k, m)`` and the options
        to store in the map.  Without a ``layout`` function rows spread round-robin (``k = servers``)."""
        if self.layout is not None:
            return self.layout(num_servers, k, m, options)
        if m:
            raise ValueError(f"strategy {self.name!r} keeps no parity: do not pass --m")
        if k not in (0, num_servers):  # (a map's own k, every server, is taken back as it is)
            raise ValueError(f"strategy {self.name!r} keeps no stripes (its rows spread over every server): do not "
                             "pass --k")
        self.parse_options(options)
        return num_servers, 0, {str(a): str(b) for a, b in options.items()}

    def load_class(self):
        """The server-side class (imports it)."""
        module_name, _, attr = self.server_class.partition(":")
        cls = getattr(importlib.import_module(module_name), attr)
        from ecrec.strategies.base import FaultToleranceStrategy

        if not (isinstance(cls, type) and issubclass(cls, FaultToleranceStrategy)):
            raise TypeError(f"strategy {self.name!r}: {self.server_class} is not a FaultToleranceStrategy")
        return cls

    def option_fields(self) -> list[dataclasses.Field]:
        return list(dataclasses.fields(self.options_type)) if self.options_type is not None else []


# --- typed options ------------------------------------------------------------------------------------------------
def _convert(strategy: str, name: str, raw: str, hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is Literal:
        if raw not in typing.get_args(hint):
            raise ValueError(f"strategy {strategy!r}: option {name}={raw!r}: choose one of {list(typing.get_args(hint))}")
        return raw
    if args and origin is not Literal:  # Optional[X]
        return _convert(strategy, name, raw, args[0])
    if hint is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"strategy {strategy!r}: option {name}={raw!r}: not a boolean")
    if hint is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"strategy {strategy!r}: option {name}={raw!r}: not an integer") from None
    if hint is float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"strategy {strategy!r}: option {name}={raw!r}: not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"strategy {strategy!r}: option {name}={raw!r}: must be finite")
        return value
    return str(raw)


def parse_options(strategy: str, options_type: type | None, options: Mapping[str, str]) -> Any:
    """``options_type`` (a dataclass) from ``KEY=VALUE`` strings; unknown keys and bad values raise ValueError."""
    options = {str(k): str(v) for k, v in (options or {}).items()}
    if options_type is None:
        if options:
            raise ValueError(f"strategy {strategy!r} takes no options, got {sorted(options)}")
        return None
    fields = {f.name: f for f in dataclasses.fields(options_type)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"strategy {strategy!r}: unknown option(s) {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(options_type)
    values = {name: _convert(strategy, name, raw, hints[name]) for name, raw in options.items()}
    parsed = options_type(**values)
    validate = getattr(parsed, "validate", None)
    if validate is not None:
        validate(strategy)
    return parsed


def options_to_strings(options: Any) -> dict[str, str]:
    """Every field of a typed options dataclass as strings (what the map carries)."""
    return {f.name: str(getattr(options, f.name)) for f in dataclasses.fields(options)}
