"""Children that end with the process that started them (Linux's ``PR_SET_PDEATHSIG``).

``ecrec-server local`` starts a coordinator, servers and etcd members; a ``kill -9`` of it gives it no chance to stop
them.  Each child asks the kernel for SIGTERM when its parent ends: an ``ecrec-server`` child itself, at the start of
its ``main`` (the parent's pid in :data:`ENV`), another program (etcd) through a few lines of Python that ask and then
``exec`` it (the request survives ``exec``).  No ``preexec_fn``: nothing runs between ``fork`` and ``exec`` in a
process that has threads.  The signal comes when the parent *thread* that forked ends: start children from a thread
that lives as long as they should (``local``'s main thread).
"""

from __future__ import annotations

import os
import signal
import sys

#: the environment variable that carries the parent's pid to an ``ecrec-server`` child
ENV = "ECREC_DIE_WITH_PARENT"

PR_SET_PDEATHSIG = 1

#: ``python -c`` code: ask for SIGTERM when the parent (argv[1]) ends, then exec argv[2:]
_EXEC = ("import ctypes, os, sys\n"
         "try:\n"
         "    ctypes.CDLL(None, use_errno=True).prctl(1, 15)\n"
         "except (OSError, AttributeError):\n"
         "    pass\n"
         "if os.getppid() != int(sys.argv[1]):\n"
         "    sys.exit(1)\n"
         "os.execv(sys.argv[2], sys.argv[2:])\n")


def die_with(parent: int, sig: int = signal.SIGTERM) -> None:
    """In a child of ``parent`` (a pid): ask for ``sig`` when the thread that forked this process ends; a parent
    that ended between the fork and the request sends none, so the child, adopted by then, ends itself."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
        pass  # no prctl here: nothing to ask for
    if os.getppid() != parent:
        os.kill(os.getpid(), int(sig))


def follow(sig: int = signal.SIGTERM) -> None:
    """In a child: when :data:`ENV` names the parent, :func:`die_with` it; the variable is removed, so this
    process's own children do not inherit it."""
    parent = os.environ.pop(ENV, None)
    if parent:
        die_with(int(parent), sig)


def env() -> dict[str, str]:
    """What a child started from this process carries for :func:`follow`."""
    return {ENV: str(os.getpid())}


def prefix() -> list[str]:
    """A command prefix that starts any program as a child that ends with this process."""
    return [sys.executable, "-I", "-S", "-c", _EXEC, str(os.getpid())]
