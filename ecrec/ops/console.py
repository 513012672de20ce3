"""What a person reads in a terminal: progress bars and tables, through ``rich`` when the stream is one.

When the stream is a terminal, :func:`progress` draws live ``rich`` progress bars (one line per label,
several at once) and :func:`print_table` draws a ``rich`` table.  Otherwise (a CI log, a pipe, a file)
both write plain lines that diff and grep well: a progress line each time a label's bar moves, and a
table as aligned columns under a dashed rule.  ``ECREC_PLAIN=1`` forces the plain form everywhere.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Sequence, TextIO

_lock = threading.Lock()
_live = None  # the rich Progress on screen while any bar runs
_tasks: dict[str, int] = {}  # label -> rich task id (of _live)
_plain_last: dict[str, int] = {}  # label -> how much of its plain bar was last printed


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal that should get ``rich`` output."""
    if os.environ.get("ECREC_PLAIN", "") not in ("", "0"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or fake stream
        return False


def progress(label: str, step: int, total: int, done: bool = False, *, plain_steps: int = 30,
             stream: TextIO | None = None) -> None:
    """Shows ``step`` of ``total`` for ``label`` on ``stream`` (default stderr); ``done`` closes the bar.

    Plain form: a line each time the bar of ``plain_steps`` characters moves, and at ``done``.
    """
    if total < 0 or step < 0:
        raise ValueError(f"progress {label!r}: step and total must be >= 0, got {step}/{total}")
    stream = sys.stderr if stream is None else stream
    shown = min(step, total)
    if is_terminal(stream):
        _rich_progress(label, shown, total, done, stream)
        return
    width = max(1, plain_steps)
    filled = int(width * shown / max(total, 1))
    with _lock:
        if not done and _plain_last.get(label) == filled:
            return  # print only when the bar moves
        _plain_last[label] = filled
        if done:
            _plain_last.pop(label, None)
    print(f"  {label:<10} [{'#' * filled}{'.' * (width - filled)}] {shown}/{total}", file=stream, flush=True)


def _rich_progress(label: str, shown: int, total: int, done: bool, stream: TextIO) -> None:
    global _live
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with _lock:
        if _live is None:
            _live = Progress(TextColumn("  {task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=Console(file=stream))
            _live.start()
            _tasks.clear()
        task = _tasks.get(label)
        if task is None:
            task = _tasks[label] = _live.add_task(label, total=total)
        _live.update(task, completed=shown, total=total)
        if done:
            _live.update(task, completed=total)
            if all(_live.tasks[i].finished for i in range(len(_live.tasks))):
                _live.stop()
                _live = None


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, title: str | None = None,
                align: str | None = None, stream: TextIO | None = None) -> None:
    """Prints ``rows`` under ``headers``; ``align`` has one letter per column, ``l`` or ``r`` (default: the
    first column left, the others right).  Cells are shown with ``str``."""
    stream = sys.stdout if stream is None else stream
    align = align or "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers) or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one of 'l'/'r' per column ({len(headers)}), got {align!r}")
    cells = [[str(c) for c in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"a row has {len(row)} cells for {len(headers)} columns: {row}")
    if is_terminal(stream):
        from rich import box
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
        for header, a in zip(headers, align):
            table.add_column(header, justify="left" if a == "l" else "right", no_wrap=True)
        for row in cells:
            table.add_row(*row)
        Console(file=stream).print(table)
        return
    if title:
        print(title, file=stream)
    lines = [list(headers), *cells]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    for n, line in enumerate(lines):
        print("  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(line, widths, align)).rstrip(),
              file=stream)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=stream)
    stream.flush()
