"""A warm parent for local clusters' processes: ``ecrec-server`` servers and coordinators forked, not started.

A server process spends about 1.5 s of CPU starting (Python and its imports, numba, the kernels loaded from
numba's cache) before it does anything; a test suite starts hundreds.  :class:`ForkServer` runs one process that
has done all of that once, with no thread, socket or gRPC object of its own, and forks it on request: the child
runs the very ``ecrec-server`` command line it was asked for (the ``ecrec.cli`` module, as ``python -m`` would
run it), with its own environment,
standard streams and process id, as a separate process that talks to the others over real sockets.
:class:`Forked` stands for it where a ``subprocess.Popen`` would (pid, poll, wait, signals, its stderr).

Opt-in, for tests and local clusters on one machine: ``ecrec.ops.local.use_spawner(Spawner())`` makes every
``LocalCluster`` of this process fork its processes (``tests/conftest.py`` does, unless ``ECREC_FORK_SERVER=0``); a
process placed elsewhere (a network namespace) or with an environment of its own still starts as a process of its
own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

#: tests/conftest.py forks local clusters' processes unless this is 0
ENV = "ECREC_FORK_SERVER"


def _preload() -> None:
    """Everything a server or a coordinator imports and loads before it serves (no thread, socket or gRPC object
    is made here: a child starts clean)."""
    import importlib

    import ecrec.config  # noqa: F401  (what the command line module imports)
    import ecrec.control.coordinator  # noqa: F401
    import ecrec.ops.logs  # noqa: F401
    import ecrec.ops.metrics  # noqa: F401
    import ecrec.server.process  # noqa: F401
    from ecrec.coding.kernels import cpu
    from ecrec.strategies import available, get_spec
    from ecrec.strategies.erasure import merge
    from ecrec.tables import spec

    for name in available():
        importlib.import_module(get_spec(name).server_class.partition(":")[0])
    spec.warm_up()
    cpu.CpuKernel()
    merge.warm_up()


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent ends (a child of a killed warm parent does not linger)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: becomes ``python -m ecrec.cli ARGS`` with the request's environment and streams
    (``request["streams"]`` names what the passed descriptors are, in order: ``stdout``, ``stderr``; a stream not
    passed is /dev/null)."""
    code = 1
    try:
        _die_with_parent()
        devnull = os.open(os.devnull, os.O_RDWR)
        passed = dict(zip(request["streams"], fds))
        os.dup2(devnull, 0)
        os.dup2(passed.get("stdout", devnull), 1)
        os.dup2(passed.get("stderr", devnull), 2)
        for fd in {devnull, *fds} - {0, 1, 2}:
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        # exactly what `python -m ecrec.cli ARGS` runs (its imports are loaded already)
        import runpy

        sys.argv = ["ecrec-server", *request["args"]]
        runpy.run_module("ecrec.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed as the process would, then the exit status says it
        import traceback

        traceback.print_exc()
    finally:
        try:
            import logging

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(control_fd: int) -> None:
    """The warm parent: preloads, says ``ready``, then forks a child per request arriving on ``control_fd``
    (JSON ``{"args", "env"}`` with the child's stdout and stderr as passed descriptors) and answers its pid; each
    child's exit status goes back as ``{"exit": pid, "code": returncode}``.  One thread (a child forks from a
    process with no other); ends, killing its children, when the other end closes."""
    import select

    _die_with_parent()  # the test process (or whatever started it) gone: so is it, and then its children
    _preload()
    control = socket.socket(fileno=control_fd)
    children: set[int] = set()

    def send(message: dict) -> None:
        control.sendall(json.dumps(message).encode() + b"\n")

    def reap() -> None:
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    buffer = b""
    send({"ready": os.getpid()})
    while True:
        readable, _, _ = select.select([control], [], [], 0.02)
        try:
            reap()
        except OSError:
            readable = [control]  # the other end is gone: the recv below says so
        if not readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(control, 1 << 16, 2)
        except OSError:
            data, fds = b"", []
        if not data:
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os._exit(0)
        buffer += data
        while b"\n" in buffer:
            line, _, buffer = buffer.partition(b"\n")
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                control.close()
                _child(request, list(fds))
            for fd in fds:
                os.close(fd)
            fds = []
            children.add(pid)
            send({"pid": pid})


class Forked:
    """A forked child seen as a ``subprocess.Popen``: ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``, and the read ends of its ``stdout`` and ``stderr`` (text) when asked for."""

    def __init__(self, server: "ForkServer", pid: int, stdout, stderr):
        self._server, self.pid, self.stdout, self.stderr = server, pid, stdout, stderr
        self.returncode: int | None = None
        self.args = ["<forked>"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client end: starts the warm parent (``env``: its environment, the children's base) and forks from it."""

    def __init__(self, env: dict, timeout_s: float = 120.0):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._proc = subprocess.Popen([sys.executable, "-m", "ecrec.ops.forks", str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._control = ours
        self._lock = threading.Lock()  # one request at a time
        self._exits: dict[int, int] = {}
        self._answers: list[dict] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, name="ecrec-fork-server", daemon=True).start()
        if self._next_answer(timeout_s).get("ready") is None:
            raise RuntimeError("the fork server did not start")

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                data = self._control.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                with self._changed:
                    self._answers.append({"closed": True})
                    self._changed.notify_all()
                return
            buffer += data
            while b"\n" in buffer:
                line, _, buffer = buffer.partition(b"\n")
                message = json.loads(line)
                with self._changed:
                    if "exit" in message:
                        self._exits[message["exit"]] = message["code"]
                    else:
                        self._answers.append(message)
                    self._changed.notify_all()

    def _next_answer(self, timeout_s: float) -> dict:
        with self._changed:
            if not self._changed.wait_for(lambda: self._answers, timeout_s):
                raise RuntimeError(f"the fork server did not answer within {timeout_s} s")
            return self._answers.pop(0)

    def spawn(self, args: list[str], env: dict, stdout: bool = False, stderr: bool = True) -> Forked:
        """Forks ``ecrec-server ARGS`` with ``env``; ``stdout``/``stderr``: give the child a pipe whose read end is
        the handle's (text), else /dev/null."""
        ends = [os.pipe() if wanted else None for wanted in (stdout, stderr)]
        streams = [name for name, end in zip(("stdout", "stderr"), ends) if end is not None]
        try:
            with self._lock:
                fds = [end[1] for end in ends if end is not None]
                message = json.dumps({"args": args, "env": env, "streams": streams}).encode() + b"\n"
                socket.send_fds(self._control, [message], fds)
                answer = self._next_answer(30.0)
        finally:
            for end in ends:
                if end is not None:
                    os.close(end[1])
        if "pid" not in answer:
            for end in ends:
                if end is not None:
                    os.close(end[0])
            raise RuntimeError(f"the fork server could not start {args}: {answer}")
        stdout_f, stderr_f = (open(e[0], "r", encoding="utf-8", errors="replace") if e is not None else None
                              for e in ends)
        return Forked(self, answer["pid"], stdout_f, stderr_f)

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        """Ends the warm parent (and any child it still has)."""
        try:
            self._control.close()
        finally:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


class Spawner:
    """What ``ecrec.ops.local.use_spawner`` takes: ``spawner(args, env, stdout)`` forks ``ecrec-server ARGS`` from a
    warm parent started on first use (with that first call's environment: the base every child's differs from
    only by what it reads when it runs, fault injection), ended at exit."""

    def __init__(self):
        self._server: ForkServer | None = None
        self._lock = threading.Lock()

    def __call__(self, args: list[str], env: dict, stdout: bool) -> Forked:
        with self._lock:
            if self._server is None:
                import atexit

                self._server = ForkServer({k: v for k, v in env.items() if k not in FORKABLE_ENV})
                atexit.register(self._server.close)
        return self._server.spawn(args, env, stdout=stdout)


#: environment a forked process may have apart from its warm parent's: read when it runs, not when it imports
FORKABLE_ENV = {"ECREC_FAULT", "ECREC_COORDINATOR_FAULT"}


if __name__ == "__main__":
    serve(int(sys.argv[1]))
