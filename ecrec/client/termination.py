"""SIGTERM waits for a worker's unconfirmed pushes, then ends the process as it would have.

torchrun, SLURM and Kubernetes stop a worker with SIGTERM.  Where the program has no handler for it, the process
died at once: the exit's wait for confirmations (``ClientConfig.confirm_at_exit_s``) never ran, and an owner
failing in the next moments lost the pushes it had acknowledged but not yet made redundant.

The first client made in the main thread where SIGTERM still has its default action (``ClientConfig.
exit_on_sigterm``, on by default; a program's own handler is left alone) installs a handler that does nothing in
the program's own code -- no exception is raised in it, so no step is cut in half.  The signal reaches a thread of
this module instead (through ``signal.set_wakeup_fd``, so it comes even while the main thread is blocked in C,
in a collective or a long kernel): it stops the clients' pushes from starting (a push already sent is let finish
and is held: up to its own ``retry_deadline_s``, so no step is applied by some servers only), waits up to the
longest ``confirm_at_exit_s`` of the clients for their pushes to be confirmed, and then ends the process by
SIGTERM's default action (the status a parent sees is the signal's, as before; no exit handler runs, as before).
A process whose clients hold nothing ends at once; a second SIGTERM ends it at once, saying nothing (a stream
it would write to may be full).  A program that installs its own SIGTERM handler later takes the signal over; if
that handler calls this one (the one it replaced), this one stops the pushes and waits as above, then gives the
program :data:`CHAINED_GRACE_S` more for its own work: a program that ends meanwhile (``sys.exit`` in its
handler) ends as it chose, its status and exit handlers its own; one still running then gets the default action it
expected of the handler it called.  A child made by ``fork`` starts with SIGTERM's default action again.  If an
event loop takes the wakeup fd, the wait starts when the main thread next runs Python.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("ecrec.client")

_lock = threading.Lock()
_begin_lock = threading.Lock()
_installed = False
_wakeup: tuple[int, int] | None = None  # (read, write) of the pipe the signal's number is written to, when ours
_open_clients = None  # () -> the clients open in this process (set at install)
_wait_confirmed = None  # (clients, deadline) -> None: waits for their pushes' confirmations until the deadline
#: set when the wait of the first SIGTERM this module handles begins
terminating = threading.Event()
#: a SIGTERM reached this module's own handler (not through the program's): the process ends by it.  A plain bool,
#: not an Event: a second SIGTERM's handler may run inside the first one's set() and wait on its lock for good
_claimed = False
_exiting = False  # the program's exit began (its exit handlers run): a chained wait no longer ends it
_libc_signal = None  # the C library's signal(), loaded at install: nothing is imported on the way out
_calls = 0  # calls of the handler for its own SIGTERMs
#: seconds a program whose own SIGTERM handler called this one is given for its own work after the wait
CHAINED_GRACE_S = 30.0


class PushGate:
    """Lets pushes of one client start until a SIGTERM closes it; closing waits for the pushes in flight, so no
    push is between sent and held by the courier when the wait for confirmations begins."""

    def __init__(self):
        self._cond = threading.Condition()
        self._inflight = 0
        self._closed = terminating.is_set()  # a client made during the wait pushes nothing either

    def __enter__(self) -> None:
        with self._cond:
            while self._closed:  # the process ends once the confirmations are waited for: this push never starts
                self._cond.wait()
            self._inflight += 1

    def __exit__(self, *exc_info) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def shut(self) -> None:
        """No push starts from now on."""
        with self._cond:
            self._closed = True

    def drain(self, deadline: float) -> bool:
        """Waits until the pushes in flight are done or ``deadline``: True if none is left."""
        with self._cond:
            while self._inflight and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            return not self._inflight

    def close(self, deadline: float) -> bool:
        """:meth:`shut`, then :meth:`drain`."""
        self.shut()
        return self.drain(deadline)


def install(open_clients, wait_confirmed) -> bool:
    """Installs the handler (see the module) if this is the main thread and SIGTERM has its default action;
    ``open_clients()`` lists this process's open clients, ``wait_confirmed(clients, deadline)`` waits for their
    pushes.  True if the handler is in place."""
    global _installed, _wakeup, _open_clients, _wait_confirmed, _libc_signal
    with _lock:
        _open_clients, _wait_confirmed = open_clients, wait_confirmed
        if _installed:
            return signal.getsignal(signal.SIGTERM) is _on_sigterm
        if threading.current_thread() is not threading.main_thread():
            return False
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return False
            signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # not the main interpreter, or no signals here
            return False
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.signal.restype = ctypes.c_void_p
            libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
            _libc_signal = libc.signal
        except (OSError, AttributeError, ImportError):  # no C library to call: _die exits with 128 + 15 instead
            _libc_signal = None
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if previous != -1:  # the program's (an event loop's): kept; the handler then starts the wait itself
            signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
        else:
            _wakeup = (read, write)
            threading.Thread(target=_watch, args=(read,), name="ecrec-sigterm", daemon=True).start()
        _installed = True
        return True


def _on_sigterm(signum, frame) -> None:
    """The Python-level handler: nothing in the program's own code; the wait starts on a thread of its own.  A
    handler the program installed after this one that calls it as the one it replaced gets the wait, then
    :data:`CHAINED_GRACE_S` for its own work; a program still running after them gets what it expected of the
    handler it called, SIGTERM's default action (one that exits meanwhile ends as it chose)."""
    global _calls, _claimed
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm:  # called by the program's handler
        _begin(signum, CHAINED_GRACE_S)
        return
    # this module's own: the signal came while it was installed (the thread reading the pipe may read it only
    # after the program has replaced it -- signal.signal() runs the pending handlers first, this one)
    _claimed = True
    # each call is a signal of its own (two that come before the first call are one call, and are two bytes in the
    # pipe :func:`_watch` counts, when it is there): a second call ends the process, whoever else counts
    _calls += 1
    if _calls > 1:
        _die(signum, None, quiet=True)
    _begin(signum, 0.0)


def _begin(signum: int, grace_s: float) -> None:
    """Starts the wait once (whoever sees the signal first: this handler or the thread reading the pipe).  Never
    blocks: a handler running in the main thread while it holds the lock (between two of its lines) returns."""
    if not _begin_lock.acquire(blocking=False):
        return
    try:
        if terminating.is_set():
            return
        terminating.set()
    finally:
        _begin_lock.release()
    _start(_terminate, signum, grace_s)


def _start(target, *args) -> None:
    try:
        threading.Thread(target=target, args=args, name="ecrec-sigterm-wait", daemon=True).start()
    except RuntimeError as exc:  # no thread can be started (the process's limit): the signal's default at once
        _die(signal.SIGTERM, f"the wait cannot start: {exc}")


def _watch(read: int) -> None:
    """Reads the numbers of the signals Python caught (every signal delivered writes its own): a SIGTERM that
    came while this module's handler was installed starts the wait (while the main thread is blocked in C, its
    handler cannot run), a second one ends the process at once."""
    seen = 0
    while True:
        try:
            data = os.read(read, 512)
        except OSError:
            return
        if not data:
            return
        count = data.count(signal.SIGTERM)
        if count and (signal.getsignal(signal.SIGTERM) is _on_sigterm or _claimed):
            seen += count
            if seen > 1:
                _die(signal.SIGTERM, None, quiet=True)
            _begin(signal.SIGTERM, 0.0)


def _terminate(signum: int, grace_s: float) -> None:
    """Stops every client's pushes, lets those in flight finish (each up to its ``retry_deadline_s``), waits for
    the confirmations of the clients that ask for it (bounded), then, ``grace_s`` later, SIGTERM's default action,
    whatever happens meanwhile (a process whose pushes cannot start any more must end) -- unless the program's
    exit began meanwhile (a handler of its own that called this one, then ``sys.exit``).  (A second SIGTERM is
    ended at once by whoever counts it first: :func:`_watch` or :func:`_on_sigterm`.)"""
    why = None
    try:
        every = _open_clients() if _open_clients else []
        for c in every:  # all of them first: none starts a push while another's is waited for
            c._push_gate.shut()
        drained = time.monotonic() + max((c.config.retry_deadline_s for c in every), default=0.0)
        for c in every:  # a push sent and not answered yet is not held yet, and would be missed
            if not c._push_gate.drain(drained):
                log.warning("SIGTERM: worker %s: a push still in flight after its retry deadline; the step may be "
                            "applied by some servers only", c.worker)
        clients = [c for c in every if c.config.exit_on_sigterm and c.config.confirm_at_exit_s > 0]
        held = sum(c.courier.unconfirmed() for c in clients)
        if not held:
            return
        deadline = time.monotonic() + max(c.config.confirm_at_exit_s for c in clients)
        log.warning("SIGTERM: waiting up to %.0f s for %d unconfirmed pushes of worker(s) %s to be confirmed, then "
                    "ending (a second SIGTERM ends it at once)", max(0.0, deadline - time.monotonic()), held,
                    ", ".join(sorted(c.worker for c in clients)))
        _wait_confirmed(clients, deadline)
        left = sum(c.courier.unconfirmed() for c in clients)
        why = f"{left} pushes still unconfirmed" if left else "every push confirmed"
    except BaseException as exc:  # noqa: BLE001 - reported; the process ends all the same
        why = f"the wait failed: {type(exc).__name__}: {exc}"
    finally:
        if grace_s > 0:
            until = time.monotonic() + grace_s
            while time.monotonic() < until and not _exiting:
                time.sleep(0.05)
            if _exiting:  # the program ends on its own terms (its handler called ours, then exited)
                return
        _die(signum, why)


def note_exiting() -> None:
    """Called as the exit's own wait begins: a program whose handler called this module's, then ended, ends as
    it chose (a chained wait no longer ends it)."""
    global _exiting
    _exiting = True


def end_if_terminating() -> None:
    """Called at the end of the exit's own wait: a process that a SIGTERM reached through this module's own
    handler ends by the signal (its parent sees what it saw before), not with the status of a program that
    ended meanwhile (a C call the signal cut short, then the end of the script).  A program whose own handler
    called this one ends with the status it chose, its exit handlers run."""
    if terminating.is_set() and _claimed:
        _die(signal.SIGTERM, None)


def _die(signum: int, why: str | None, quiet: bool = False) -> None:
    """SIGTERM's default action, from any thread: the process ends as the signal would have ended it.  ``quiet``:
    nothing is logged or flushed first (a second SIGTERM: the main thread may hold a full stream's lock)."""
    if not quiet:
        if why:
            log.warning("SIGTERM: ending (%s)", why)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
                pass
        for handler in logging.getLogger().handlers + log.handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - a handler that cannot flush loses its last lines, nothing more
                pass
    try:
        if _libc_signal is not None:
            _libc_signal(signum, 0)  # SIG_DFL, set from this thread (Python cannot)
            os.kill(os.getpid(), signum)
            time.sleep(1.0)  # the signal is delivered to some thread of the process; it ends
    finally:
        os._exit(128 + signum)  # no C library to call: the status a shell reports for the signal


_fork_masks = threading.local()


def _before_fork() -> None:
    """SIGTERM is held in the forking thread across a fork: the child starts with it blocked, and a SIGTERM sent to
    it before it has reset its handler (``terminate()`` right after ``start()``) waits for that reset instead of
    reaching the parent's wait through the pipe the two share."""
    if _installed:
        _fork_masks.previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _after_fork_in_parent() -> None:
    previous = getattr(_fork_masks, "previous", None)
    if previous is not None:
        _fork_masks.previous = None
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _after_fork_in_child() -> None:
    """A child made by fork starts with SIGTERM's default action (the parent's pipe and thread are not its)."""
    try:
        _reset_in_child()
    finally:
        _after_fork_in_parent()  # the mask as it was before the fork: a SIGTERM held meanwhile ends the child now


def _reset_in_child() -> None:
    global _installed, _wakeup, _calls, _claimed, _exiting
    if not _installed:
        return
    _installed = False
    _calls = 0
    _claimed = _exiting = False
    wakeup, _wakeup = _wakeup, None
    terminating.clear()
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if wakeup is not None:
            previous = signal.set_wakeup_fd(-1)
            if previous != wakeup[1]:  # the program's since: kept
                signal.set_wakeup_fd(previous)
            os.close(wakeup[0])
            os.close(wakeup[1])
    except (ValueError, OSError):
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
