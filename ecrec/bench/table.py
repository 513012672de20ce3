"""The benchmarks' terminal tables: rows of figures (dicts) under columns ``(key, title, format)``, one cell a
value formatted, ``-`` where it is missing (printed by :func:`ecrec.ops.console.print_table`)."""

from __future__ import annotations

from typing import Callable


def cell(value, fmt: str | Callable) -> str:
    """``value`` as ``fmt`` says (a format string, or a function for what one cannot say: :func:`megabytes`,
    :func:`span`); ``-`` when it is missing."""
    if value is None:
        return "-"
    return fmt(value) if callable(fmt) else fmt.format(value)


def megabytes(spec: str) -> Callable:
    """A format for bytes shown in MB with ``spec``."""
    return lambda v: spec.format(v / 1e6)


def span(spec: str) -> Callable:
    """A format for a ``(low, high)`` pair, each with ``spec``: ``[low, high]`` (a dash would read as a minus sign
    next to a negative figure: ``-0.37--0.37``)."""
    return lambda v: f"[{spec.format(v[0])}, {spec.format(v[1])}]"


def print_rows(rows: list[dict], columns, stream=None, cell_of: Callable | None = None) -> None:
    """``rows`` under ``columns`` (``(key, title, format)``); ``cell_of(row, key, format)`` makes a cell (default:
    :func:`cell` of ``row[key]``)."""
    from ecrec.ops.console import print_table

    cell_of = cell_of or (lambda row, key, fmt: cell(row.get(key), fmt))
    print_table([title for _, title, _ in columns], [[cell_of(r, key, f) for key, _, f in columns] for r in rows],
                stream=stream)
