"""A warm parent for local clusters' processes: ``ecrec-server`` servers and coordinators forked, not started.

A server process spends about 1.5 s of CPU starting (Python and its imports, numba, the kernels loaded from
numba's cache) before it does anything; a test suite starts hundreds.  :class:`ForkServer` runs one process that
has done all of that once, with no thread, socket or gRPC object of its own, and forks it on request: the child
runs the very ``ecrec-server`` command line it was asked for (the ``ecrec.cli`` module, as ``python -m`` would
run it), with its own environment, standard streams and process id, as a separate process that talks to the
others over real sockets.  :class:`Forked` stands for it where a ``subprocess.Popen`` would (pid, poll, wait,
signals, its streams); the CPU its children used is counted (:meth:`ForkServer.children_cpu_s`).

Opt-in, for tests and local clusters on one machine: ``ecrec.ops.local.use_spawner(Spawner())`` makes every
``LocalCluster`` of this process fork its processes (``tests/conftest.py`` does, unless ``ECREC_FORK_SERVER=0``); a
process placed elsewhere (a network namespace) or with an environment that differs from the warm parent's in
anything but fault injection still starts as a process of its own.
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
#: environment a forked process may have apart from its warm parent's: read when it runs, not when it imports
#: (fault injection), or set by the test runner and read by nothing here (``PYTEST_CURRENT_TEST`` changes per test)
FORKABLE_ENV = frozenset({"ECREC_FAULT", "ECREC_COORDINATOR_FAULT"})
FORKABLE_PREFIXES = ("PYTEST_",)
#: how long a spawn waits for the warm parent's answer
SPAWN_TIMEOUT_S = 30.0


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
    from ecrec.snapshot import bulk
    from ecrec.strategies import available, get_spec
    from ecrec.strategies.erasure import merge
    from ecrec.tables import spec

    for name in available():
        importlib.import_module(get_spec(name).server_class.partition(":")[0])
    spec.warm_up()
    cpu.CpuKernel()
    merge.warm_up()
    bulk.warm_up()


def _die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when the thread that forked it ends (the warm parent has one thread: a
    child of a killed warm parent does not linger)."""
    from ecrec.ops import parent as parent_process

    parent_process.die_with(parent, signal.SIGKILL)


def _exit_code(exc: SystemExit) -> int:
    """The status Python itself exits with for ``SystemExit(code)`` (a message is printed on stderr first)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _child(request: dict, fds: list[int], parent: int) -> None:
    """In the forked child: becomes ``python -m ecrec.cli ARGS`` with the request's environment and streams
    (``request["streams"]`` names what the passed descriptors are, in order: ``stdout``, ``stderr``; a stream not
    passed is /dev/null)."""
    code = 1
    try:
        _die_with_parent(parent)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
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
        # exactly what `python -m ecrec.cli ARGS` runs (its imports are loaded already)
        import runpy

        sys.argv = ["ecrec-server", *request["args"]]
        runpy.run_module("ecrec.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
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
    (JSON ``{"id", "args", "env", "streams"}`` with the streams as passed descriptors) and answers
    ``{"id", "pid"}``; each child's end goes back as ``{"exit": pid, "id": its request's, "code": returncode,
    "cpu_s": its CPU}`` (the id says which child: once reaped, its pid may be a later child's).  One
    thread (a child forks from a process with no other), woken by the control socket or SIGCHLD; ends, killing its
    children, when the other end closes (whatever ended the process that started it)."""
    import select

    _preload()
    control = socket.socket(fileno=control_fd)
    children: dict[int, int] = {}  # pid -> the id of the request that forked it
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select through the pipe

    def send(message: dict) -> None:
        control.sendall(json.dumps(message).encode() + b"\n")

    def reap() -> None:
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not pid:
                return
            send({"exit": pid, "id": children.pop(pid, -1), "code": os.waitstatus_to_exitcode(status),
                  "cpu_s": usage.ru_utime + usage.ru_stime})

    def end() -> None:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)

    buffer, fds = b"", []
    parent = os.getpid()
    send({"ready": parent})
    while True:
        readable, _, _ = select.select([control, wake_r], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        try:
            reap()
        except OSError:
            end()  # the other end is gone
        if control not in readable:
            continue
        try:
            data, more, _, _ = socket.recv_fds(control, 1 << 20, 8)
        except OSError:
            data, more = b"", []
        if not data:
            end()
        buffer += data
        fds += more  # a request's descriptors stay with it, however its bytes were split
        while b"\n" in buffer:
            line, _, buffer = buffer.partition(b"\n")
            request = json.loads(line)
            if "signal" in request:  # sent here, where children are reaped: a child listed is not reaped, so its
                # pid is still its own (a signal by pid from the other end could reach a later process given it)
                sent = False
                for pid, request_id in children.items():
                    if request_id == request["signal"]:
                        try:
                            os.kill(pid, request["sig"])
                            sent = True
                        except ProcessLookupError:
                            pass
                send({"id": request["id"], "signalled": sent})
                continue
            mine, fds = fds[:len(request["streams"])], fds[len(request["streams"]):]
            pid = os.fork()
            if pid == 0:
                control.close()
                os.close(wake_r)
                os.close(wake_w)
                _child(request, mine, parent)
            for fd in mine:
                os.close(fd)
            children[pid] = request["id"]
            send({"id": request["id"], "pid": pid})


class Forked:
    """A forked child seen as a ``subprocess.Popen``: ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``, and the read ends of its ``stdout`` and ``stderr`` (text) when asked for."""

    def __init__(self, server: "ForkServer", pid: int, request_id: int, stdout, stderr):
        self._server, self.pid, self.stdout, self.stderr = server, pid, stdout, stderr
        self._id = request_id  # which child this is: its pid is another's once it has exited and been reaped
        self.returncode: int | None = None
        self.args = ["<forked>"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self._id)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait_exit(self._id, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        """Signals the child through its warm parent, which reaps it: never a later process given its pid."""
        if self.poll() is None:
            self._server.signal(self._id, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client end: starts the warm parent (``env``: its environment, the children's base) and forks from it.
    If the warm parent ends, its children are gone too (they die with it): they read as killed, and a spawn fails
    at once."""

    def __init__(self, env: dict, timeout_s: float = 120.0):
        self.env = dict(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._proc = subprocess.Popen([sys.executable, "-m", "ecrec.ops.forks", str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),), env=self.env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._control = ours
        self._lock = threading.Lock()  # one request at a time
        self._next_id = 0
        # by request id, not pid: a pid is reused once its child is reaped (a long test run forks thousands), and
        # a later child read by its pid as the earlier one's exit was taken for dead -- never stopped, never found
        self._exits: dict[int, int] = {}
        self._live: set[int] = set()  # request ids of children spawned and not yet known to have exited
        self._cpu_s = 0.0  # CPU of the children that exited
        self._answers: dict[int, dict] = {}
        self._closed = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, name="ecrec-fork-server", daemon=True).start()
        with self._changed:
            if not self._changed.wait_for(lambda: -1 in self._answers or self._closed, timeout_s) or self._closed:
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
                    self._closed = True
                    for request_id in self._live:  # died with their warm parent
                        self._exits.setdefault(request_id, -signal.SIGKILL)
                    self._live.clear()
                    self._changed.notify_all()
                return
            buffer += data
            while b"\n" in buffer:
                line, _, buffer = buffer.partition(b"\n")
                message = json.loads(line)
                with self._changed:
                    if "exit" in message:
                        self._exits[message["id"]] = message["code"]
                        self._live.discard(message["id"])
                        self._cpu_s += message.get("cpu_s", 0.0)
                    else:
                        self._answers[message.get("id", -1)] = message
                    self._changed.notify_all()

    def spawn(self, args: list[str], env: dict, stdout: bool = False, stderr: bool = True) -> Forked:
        """Forks ``ecrec-server ARGS`` with ``env``; ``stdout``/``stderr``: give the child a pipe whose read end is
        the handle's (text), else /dev/null."""
        ends = [os.pipe() if wanted else None for wanted in (stdout, stderr)]
        streams = [name for name, end in zip(("stdout", "stderr"), ends) if end is not None]
        answer = None
        try:
            with self._lock:
                self._next_id += 1
                request_id = self._next_id
                message = json.dumps({"id": request_id, "args": args, "env": env, "streams": streams}).encode()
                with self._changed:
                    if self._closed:
                        raise RuntimeError("the fork server has ended")
                socket.send_fds(self._control, [message + b"\n"], [end[1] for end in ends if end is not None])
                with self._changed:
                    self._changed.wait_for(lambda: request_id in self._answers or self._closed, SPAWN_TIMEOUT_S)
                    answer = self._answers.pop(request_id, None)
                    if answer is not None:
                        self._live.add(request_id)
        finally:
            for end in ends:
                if end is not None:
                    os.close(end[1])
                    if answer is None:
                        os.close(end[0])
        if answer is None:
            raise RuntimeError(f"the fork server did not start {args} within {SPAWN_TIMEOUT_S} s")
        stdout_f, stderr_f = (open(e[0], "r", encoding="utf-8", errors="replace") if e is not None else None
                              for e in ends)
        return Forked(self, answer["pid"], request_id, stdout_f, stderr_f)

    def signal(self, request_id: int, sig: int) -> None:
        """Has the warm parent send ``sig`` to the child that request forked, if it has not reaped it (nothing once
        the warm parent has ended)."""
        with self._lock:
            self._next_id += 1
            asked = self._next_id
            with self._changed:
                if self._closed:
                    return
            try:
                self._control.sendall(json.dumps({"id": asked, "signal": request_id, "sig": int(sig)}).encode()
                                      + b"\n")
            except OSError:
                return  # the warm parent is gone: so are its children
            with self._changed:  # sent when this returns (a SIGSTOP: the child is stopped, as os.kill would leave it)
                self._changed.wait_for(lambda: asked in self._answers or self._closed, SPAWN_TIMEOUT_S)
                self._answers.pop(asked, None)

    def exit_code(self, request_id: int) -> int | None:
        """The exit status of the child that request forked, None while it runs."""
        with self._changed:
            return self._exits.get(request_id)

    def wait_exit(self, request_id: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: request_id in self._exits, timeout)
            return self._exits.get(request_id)

    def children_cpu_s(self) -> float:
        """CPU seconds (user and system) the children that exited so far used."""
        with self._changed:
            return self._cpu_s

    def close(self) -> None:
        """Ends the warm parent (and any child it still has)."""
        try:
            try:  # shut down, not only closed: the reader thread's recv holds the socket, so a close alone would not
                self._control.shutdown(socket.SHUT_RDWR)  # reach the warm parent until the wait below timed out
            except OSError:
                pass
            self._control.close()
        finally:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


class Spawner:
    """What ``ecrec.ops.local.use_spawner`` takes: ``spawner(args, env, stdout)`` forks ``ecrec-server ARGS`` from a
    warm parent started on first use (with that call's environment less fault injection: every child's must equal
    it but for that), ended at exit; None when ``env`` differs (the caller starts a process of its own)."""

    def __init__(self):
        self._server: ForkServer | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _base(env: dict) -> dict:
        return {k: v for k, v in env.items() if k not in FORKABLE_ENV and not k.startswith(FORKABLE_PREFIXES)}

    def __call__(self, args: list[str], env: dict, stdout: bool) -> Forked | None:
        with self._lock:
            if self._server is None:
                import atexit

                self._server = ForkServer(self._base(env))
                atexit.register(self._server.close)
            server = self._server
        if self._base(env) != server.env:
            return None
        return server.spawn(args, env, stdout=stdout)

    def children_cpu_s(self) -> float:
        """CPU seconds the forked processes that exited so far used (0 before the first)."""
        return self._server.children_cpu_s() if self._server is not None else 0.0


if __name__ == "__main__":
    serve(int(sys.argv[1]))
