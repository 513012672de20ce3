"""What the benchmarks check before anything runs: a file or directory they will write, and whether tables fit in
this machine's memory.  Each check returns a sentence naming the flag, or None."""

from __future__ import annotations

import os
import tempfile

from ecrec.config import MAX_LOCAL_SERVERS  # the most embedding servers a benchmark starts on one machine

#: the most steps, and samples per step, a benchmark is asked for (beyond them a run would never end or its batch
#: never fit)
MAX_STEPS = 10**9
MAX_BATCH_SIZE = 1 << 20


def count_problem(flag: str, value: int, most: int, why: str) -> str | None:
    """Why ``value`` of ``flag`` is past ``most``, or None."""
    if value > most:
        return f"{flag} {value:,}: at most {most:,} ({why})"
    return None


def servers_problem(servers: int) -> str | None:
    """Why a benchmark cannot start ``servers`` server processes here, or None."""
    return count_problem("--servers", servers, MAX_LOCAL_SERVERS, "each is a process of its own on this machine")


def file_problem(flag: str, path: str) -> str | None:
    """Why ``path`` cannot be written, or None.  Tried by opening it for writing (removed again when it did not
    exist): ``os.access`` says yes to root and knows nothing of read-only or virtual filesystems (``/proc``)."""
    if not path.strip():
        return f"{flag} is empty; name a file to write"
    if os.path.isdir(path):
        return f"{flag} {path}: is a directory; name a file to write"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{flag} {path}: no directory {folder} to write it in (nothing was run)"
    if os.path.exists(path) and not os.path.isfile(path):
        return None  # a device or a pipe: opened only by the run (a pipe's open waits for its reader)
    created = not os.path.exists(path)
    try:
        with open(path, "a"):  # appends nothing: what the file holds stays until the run writes it
            pass
    except OSError as exc:
        where = f"created in {folder}" if created else "written"
        return f"{flag} {path}: cannot be {where}: {exc.strerror or exc} (nothing was run)"
    if created:
        try:
            os.unlink(os.path.realpath(path))  # a dangling link's target, not the link
        except OSError:
            pass
    return None


def directory_problem(flag: str, path: str) -> str | None:
    """Why the run cannot create ``path`` (when missing) and write in it, or None.  Tried by creating it and a file
    in it; what the try created is removed again."""
    if not path.strip():
        return f"{flag} is empty; name a directory"
    target = os.path.abspath(path)
    missing = []
    step = target
    while not os.path.lexists(step) and os.path.dirname(step) != step:
        missing.append(step)
        step = os.path.dirname(step)
    if os.path.lexists(step) and not os.path.isdir(step):
        return f"cannot use {flag} {path}: {step} is not a directory (nothing was run)"
    try:
        os.makedirs(target, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=target, prefix=".ecrec-bench-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot use {flag} {path}: {exc.strerror or exc} (nothing was run)"
    finally:
        for made in missing:  # deepest first
            try:
                os.rmdir(made)
            except OSError:
                pass
    return None


def machine_memory() -> int:
    """This machine's physical memory in bytes (every local server runs here)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - not on Linux
        return 1 << 62


def tables_problem(what: str, tables: int, rows: int, dim: int, optimizer: str, k: int = 0, m: int = 0) -> str | None:
    """Why ``tables`` tables of ``rows`` x ``dim`` (and ecrec's parity, ``m`` rows per ``k``) cannot be held by the
    servers on this machine, or None: found before any cluster starts, not by the coordinator's refusal after."""
    from ecrec.tables.spec import TableSpec

    try:
        row_bytes = TableSpec("x", 1, dim, optimizer=optimizer).row_bytes
    except ValueError as exc:
        return f"--dim {dim}: {exc}"
    needed = tables * rows * row_bytes
    if k > 0 and m > 0:
        needed += -(-needed * m // k)  # the parity rows beside them
    have = machine_memory()
    if needed <= have:
        return None
    parity = f" with ecrec's parity (m/k = {m}/{k})" if k > 0 and m > 0 else ""
    return (f"{what}: the servers would hold {needed / 1e9:,.3g} GB of tables{parity}, more than this machine's "
            f"{have / 1e9:,.1f} GB of memory (nothing was started)")
