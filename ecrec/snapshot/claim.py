"""One save at a time to a snapshot path: the in-progress marker as a claim.

A save puts its marker beside the files before it writes any (created exclusively: a hard link of a file
already written whole, so that no other save ever reads it half written), naming who holds it -- a token, the
host and its pid namespace, the pid, when it began -- and keeps it fresh (the time of its last refresh, by its
own clock) every :data:`REFRESH_S` while it writes.  A second save to the path is refused while the marker's
holder lives.  A holder is gone when the marker names a process of this host (and pid namespace) that no longer
runs, when it was not refreshed for :data:`STALE_S` (hosts' clocks must agree within that), or when it names
nobody (an empty marker, as earlier releases wrote): that is an interrupted save, taken over, its files written
over.  Before its manifest, and when it lets go, a save checks the marker is still its own.  A ``file://`` URL is
the local directory it names; on another store the marker is created exclusively where the store can (fsspec's
``"xb"`` mode: memory, s3fs, gcsfs), else written, then read back: two saves starting within one write of each
other may then both go on, and are told at their manifests.  On such a store the takeover of an interrupted save's
marker (read, removed, created again) is not exclusive either: two saves taking one over at once may both go on.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import uuid

from ecrec.snapshot import files as snapshot_files

log = logging.getLogger("ecrec.snapshot")

#: a marker not refreshed for this long is an interrupted save's (its holder on another host, or frozen) (s)
STALE_S = 30.0
#: a save refreshes its marker this often while it writes (s)
REFRESH_S = 5.0


class PathBusy(RuntimeError):
    """Another save is writing to the path now."""


def _holder(path: str, name: str) -> tuple[dict | None, float | None]:
    """The marker's holder (None: nobody named, or no marker) and the seconds since it was refreshed (None: no
    marker)."""
    try:
        if snapshot_files.is_url(path):
            import fsspec

            fs, target = fsspec.core.url_to_fs(snapshot_files.join(path, name))
            with fs.open(target, "rb") as f:
                data = f.read()
        else:
            with open(os.path.join(path, name), "rb") as f:
                data = f.read()
    except FileNotFoundError:
        return None, None
    try:
        holder = json.loads(data.decode()) if data else None
    except (UnicodeDecodeError, ValueError):
        holder = None
    if not (isinstance(holder, dict) and isinstance(holder.get("token"), str)):
        return None, 0.0  # names nobody: an earlier release's empty marker, or not a marker
    # the holder's own clock, written into the marker at each refresh: no file system's modification time (an
    # NFS client caches them for up to a minute; object stores name them differently, or not at all)
    refreshed = holder.get("refreshed", holder.get("started"))
    age = time.time() - refreshed if isinstance(refreshed, (int, float)) else STALE_S + 1.0
    return holder, max(age, 0.0)


def _alive(holder: dict | None, age: float) -> bool:
    """Whether the save a marker names may still be writing."""
    if holder is None or age > STALE_S:
        return False
    if (holder.get("host") == socket.gethostname() and holder.get("pidns") == _pid_namespace()
            and isinstance(holder.get("pid"), int)):  # a pid of this host's, in this pid namespace: asked
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return True


def describe(holder: dict) -> str:
    began = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(began)) if isinstance(began, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {when}"


class Claim:
    """This save's hold on ``path`` (:func:`take`); :meth:`release` lets go."""

    def __init__(self, path: str, name: str, token: str):
        self.path, self.name, self.token = path, name, token
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh, name="ecrec-save-claim", daemon=True)
        self._refresher.start()

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                holder, _ = _holder(self.path, self.name)
                if holder is None or holder["token"] != self.token:
                    return  # taken over (this save stalled): the new holder's marker is not refreshed from here
                snapshot_files.write_atomically(self.path, self.name,
                                                _body(self.token, holder.get("started")))
            except OSError:
                pass  # a store that cannot be reached now: held checks the marker before the manifest

    def held(self) -> bool:
        """Whether the marker still names this save (no other save took the path over meanwhile); False when it
        cannot be read (this save cannot tell: it writes no manifest, removes nothing)."""
        try:
            holder, _ = _holder(self.path, self.name)
        except OSError:
            return False
        return holder is not None and holder["token"] == self.token

    def abandon(self) -> None:
        """Stops refreshing (a refresh under way ends first), leaving the marker as it is (another save's now, out
        of reach, or moved away with the directory it was in)."""
        self._stop.set()
        if self._refresher is not threading.current_thread():
            self._refresher.join()

    def check(self) -> None:
        if not self.held():
            holder, _ = _holder(self.path, self.name)
            by = f" by {describe(holder)}" if holder is not None else ""
            raise PathBusy(f"{self.path} was taken over{by} while this save wrote (it stalled past {STALE_S:g} s); "
                           "this save did not complete")

    def release(self) -> None:
        """Stops refreshing and removes the marker if it is still this save's; a marker that cannot be removed (the
        store out of reach) is logged and left: the next save takes it over once it is stale."""
        self._stop.set()
        self._refresher.join()
        if self.held():
            try:
                snapshot_files.remove(self.path, self.name)
            except OSError as exc:
                log.warning("%s: the in-progress marker %s could not be removed (%s); the next save takes it over",
                            self.path, self.name, exc.strerror or exc)


def _pid_namespace() -> str | None:
    """This process's pid namespace (``pid:[4026531836]``): two containers of one host name do not share pids."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _body(token: str, started: float | None = None) -> bytes:
    now = time.time()
    return json.dumps({"token": token, "host": socket.gethostname(), "pidns": _pid_namespace(), "pid": os.getpid(),
                       "started": now if started is None else started, "refreshed": now}).encode()


def take(path: str, name: str) -> Claim:
    """Claims ``path`` (an existing directory or URL) for one save: raises :class:`PathBusy` naming the save that
    writes there now; takes over an interrupted save's marker."""
    # a file:// URL as the local path it names: its marker then written and refreshed as a local file's (beside
    # it and renamed, never truncated in place where another save could read it empty)
    if str(path).startswith("file://"):
        path = snapshot_files.local_dir(path) or path
    token = uuid.uuid4().hex
    body = _body(token)
    claim = None
    try:
        if snapshot_files.is_url(path):
            _create_url(path, name, body)
        else:
            _create_local(path, name, body)
        claim = Claim(path, name, token)
        if not claim.held():  # a store without exclusive creation: another save wrote its marker after ours
            holder, _ = _holder(path, name)
            raise PathBusy(f"another save is writing a snapshot to {path}"
                           f"{f' ({describe(holder)})' if holder is not None else ''}")
        return claim
    except BaseException:  # refused, or interrupted (Ctrl-C, SIGTERM) after the marker was made: not left behind
        if claim is not None:
            claim._stop.set()
        holder, _ = _holder(path, name)
        if holder is not None and holder["token"] == token:
            snapshot_files.remove(path, name)
        raise


#: a marker that names nobody is read again this often, this far apart: one being created exclusively on a store
#: is empty until its write ends (an earlier release's empty marker stays empty)
SETTLE_READS, SETTLE_S = 10, 0.2


def _settled_holder(path: str, name: str) -> tuple[dict | None, float | None]:
    holder, age = _holder(path, name)
    for _ in range(SETTLE_READS):
        if holder is not None or age is None:
            break
        time.sleep(SETTLE_S)
        holder, age = _holder(path, name)
    return holder, age


def _busy(path: str, holder: dict | None) -> PathBusy:
    return PathBusy(f"another save is writing a snapshot to {path}{f' ({describe(holder)})' if holder else ''}; "
                    "wait for it to end or choose another path")


def _create_url(path: str, name: str, body: bytes) -> None:
    """The marker on an fsspec URL: a local directory's way on ``file://``; elsewhere created exclusively
    (``"xb"``) where the store can, an interrupted save's marker removed first (unless another save replaced it
    meanwhile); on a store that cannot, written (:func:`take` reads it back)."""
    import fsspec

    local = snapshot_files.local_dir(path)
    if local is not None:
        _create_local(local, name, body)
        return
    fs, target = fsspec.core.url_to_fs(snapshot_files.join(path, name))
    for _ in range(3):
        # asked first: a store may take "xb" and not enforce it (fsspec's ftp and webhdfs write over)
        holder, age = _settled_holder(path, name)
        if age is not None and _alive(holder, age):
            raise _busy(path, holder)
        try:
            with fs.open(target, "xb") as f:
                f.write(body)
            return
        except FileExistsError:
            pass
        except (ValueError, NotImplementedError, TypeError):  # a store without exclusive creation
            holder, age = _settled_holder(path, name)
            if age is not None and _alive(holder, age):
                raise _busy(path, holder) from None
            snapshot_files.write_atomically(path, name, body)
            return
        holder, age = _settled_holder(path, name)
        if age is None:
            continue  # let go of meanwhile: try again
        if _alive(holder, age):
            raise _busy(path, holder)
        again, _ = _holder(path, name)
        if (again or {}).get("token") != (holder or {}).get("token"):
            raise _busy(path, again)  # another save took the interrupted one's marker over first
        try:
            fs.rm(target)
        except FileNotFoundError:
            pass
    raise PathBusy(f"another save is writing a snapshot to {path}: its marker came and went three times")


def _create_local(path: str, name: str, body: bytes) -> None:
    """The marker made exclusively: written whole beside it, then linked to its name (EEXIST: a marker is
    there); a marker whose holder is gone is first moved aside (only one save moves it: the one that finds in
    what it moved the marker it judged gone)."""
    marker = os.path.join(path, name)
    tmp = os.path.join(path, f".{name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(body)
        snapshot_files.durable(f)
    try:
        for _ in range(3):
            try:
                os.link(tmp, marker)
                snapshot_files.sync_directory(path)
                return
            except FileExistsError:
                pass
            holder, age = _holder(path, name)
            if age is None:
                continue  # let go of meanwhile: try again
            if _alive(holder, age):
                raise PathBusy(f"another save is writing a snapshot to {path} ({describe(holder)}); wait for it "
                               "to end or choose another path")
            aside = os.path.join(path, f".{name}.{uuid.uuid4().hex}.gone")
            try:
                os.rename(marker, aside)
            except FileNotFoundError:
                continue
            moved, _ = _holder(path, os.path.basename(aside))
            if (moved or {}).get("token") != (holder or {}).get("token"):
                # another save took the stale marker over first: what was moved is its fresh one, put back
                try:
                    os.link(aside, marker)
                except OSError as exc:
                    if exc.errno != errno.EEXIST:
                        raise
                os.unlink(aside)
                raise PathBusy(f"another save is writing a snapshot to {path}"
                               f"{f' ({describe(moved)})' if moved else ''}; wait for it to end or choose another path")
            os.unlink(aside)
        raise PathBusy(f"another save is writing a snapshot to {path}: its marker came and went three times")
    finally:
        os.unlink(tmp)
