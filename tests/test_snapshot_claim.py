"""One save at a time to a snapshot path (``ecrec.snapshot.claim``): the in-progress marker names its holder,
a second save is refused while the holder lives, a marker whose holder is gone is taken over.  Real files,
real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from ecrec.snapshot import claim
from ecrec.snapshot.cluster import WRITING

HOLD = ("import sys, time; from ecrec.snapshot import claim; claim.take(sys.argv[1], sys.argv[2]); "
        "print('held', flush=True); time.sleep(600)")


def _hold(path) -> subprocess.Popen:
    """Another process holding ``path``'s claim until killed."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), WRITING], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_claim_is_refused_while_its_holder_lives_and_taken_once_it_is_gone(tmp_path):
    holder = _hold(tmp_path)
    try:
        marker = json.loads((tmp_path / WRITING).read_text())
        assert marker["pid"] == holder.pid
        with pytest.raises(claim.PathBusy, match=f"another save is writing a snapshot to .*pid {holder.pid}"):
            claim.take(str(tmp_path), WRITING)
        assert json.loads((tmp_path / WRITING).read_text()) == marker  # the holder's marker untouched
    finally:
        holder.kill()
        holder.wait()
    mine = claim.take(str(tmp_path), WRITING)  # a dead process's marker: an interrupted save, taken over
    assert json.loads((tmp_path / WRITING).read_text())["pid"] == os.getpid() and mine.held()
    mine.release()
    assert not (tmp_path / WRITING).exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file left either


def test_a_claim_of_this_process_refuses_another_thread_and_is_kept_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(claim, "REFRESH_S", 0.05)
    first = claim.take(str(tmp_path), WRITING)
    try:
        began = json.loads((tmp_path / WRITING).read_text())["started"]
        time.sleep(0.3)
        marker = json.loads((tmp_path / WRITING).read_text())
        assert marker["refreshed"] > began and marker["started"] == began  # refreshed while held, by its clock
        with pytest.raises(claim.PathBusy, match=f"pid {os.getpid()}"):
            claim.take(str(tmp_path), WRITING)
    finally:
        first.release()


def test_a_stale_marker_of_another_host_or_of_nobody_is_taken_over(tmp_path):
    now = time.time()
    body = {"token": "t", "host": "some-other-host", "pid": 1, "started": now, "refreshed": now}
    (tmp_path / WRITING).write_text(json.dumps(body))
    with pytest.raises(claim.PathBusy, match="some-other-host"):  # fresh: its holder may be writing
        claim.take(str(tmp_path), WRITING)
    body["refreshed"] = now - claim.STALE_S - 5
    (tmp_path / WRITING).write_text(json.dumps(body))
    claim.take(str(tmp_path), WRITING).release()  # not refreshed for STALE_S: gone
    body = {"token": "t", "host": claim.socket.gethostname(), "pidns": "pid:[another container]", "pid": 1,
            "started": now, "refreshed": time.time()}
    (tmp_path / WRITING).write_text(json.dumps(body))
    with pytest.raises(claim.PathBusy):  # a pid of another pid namespace is not asked here: fresh, alive
        claim.take(str(tmp_path), WRITING)
    (tmp_path / WRITING).write_bytes(b"")  # an earlier release's marker names nobody
    taken = claim.take(str(tmp_path), WRITING)
    assert taken.held()
    taken.release()


def test_a_save_whose_path_was_taken_over_does_not_complete_nor_remove_the_new_holders_marker(tmp_path,
                                                                                          monkeypatch):
    """... nor keeps the new holder's marker fresh (its refresher touched whatever marker was there, so a new
    holder that died was never stale while this process lived)."""
    monkeypatch.setattr(claim, "REFRESH_S", 0.05)
    mine = claim.take(str(tmp_path), WRITING)
    other = {"token": "other", "host": "h", "pid": 7, "started": 0, "refreshed": time.time() - 100}
    (tmp_path / WRITING).write_text(json.dumps(other))
    with pytest.raises(claim.PathBusy, match="taken over by pid 7 on h"):
        mine.check()
    time.sleep(0.3)
    assert json.loads((tmp_path / WRITING).read_text()) == other  # not refreshed from here
    assert not mine._refresher.is_alive()
    mine.release()
    assert json.loads((tmp_path / WRITING).read_text()) == other


def test_many_claims_at_once_one_wins(tmp_path):
    outcomes, barrier = [], threading.Barrier(8)

    def race():
        barrier.wait()
        try:
            outcomes.append(claim.take(str(tmp_path), WRITING))
        except claim.PathBusy:
            outcomes.append(None)

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [c for c in outcomes if c is not None]
    assert len(won) == 1 and len(outcomes) == 8
    won[0].release()


def _race(path: str, n: int = 8) -> list:
    outcomes, barrier = [], threading.Barrier(n)

    def race():
        barrier.wait()
        try:
            outcomes.append(claim.take(path, WRITING))
        except claim.PathBusy:
            outcomes.append(None)

    threads = [threading.Thread(target=race) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


@pytest.mark.parametrize("scheme", ["file"])
def test_on_a_url_many_claims_at_once_one_wins(tmp_path, scheme):
    """On an fsspec URL the marker was written and read back: two saves that both found no marker before either
    wrote both went on, writing over each other's files.  ``file://`` is its local directory now (a store that
    creates exclusively, s3fs or gcsfs, does so at the store: fsspec's in-process memory store checks and
    creates in two steps, no model of one)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads interleave between a store's calls, as processes would
    try:
        _race_rounds(tmp_path, scheme)
    finally:
        sys.setswitchinterval(interval)


def _race_rounds(tmp_path, scheme: str) -> None:
    for attempt in range(20):
        base = f"{scheme}://{tmp_path}/{attempt}"
        from ecrec.snapshot import files as snapshot_files

        snapshot_files.makedirs(base)
        outcomes = _race(base)
        won = [c for c in outcomes if c is not None]
        assert len(outcomes) == 8 and len(won) == 1, f"attempt {attempt}: {len(won)} of 8 saves took {base}"
        won[0].release()


def test_on_a_url_an_interrupted_saves_marker_is_taken_over_and_a_live_one_refused():
    import fsspec

    base = f"memory://claim-takeover-{os.getpid()}"
    fs, root = fsspec.core.url_to_fs(base)
    fs.makedirs(root, exist_ok=True)
    now = time.time()
    live = {"token": "t", "host": "some-other-host", "pid": 1, "started": now, "refreshed": now}
    fs.pipe(f"{root}/{WRITING}", json.dumps(live).encode())
    with pytest.raises(claim.PathBusy, match="some-other-host"):
        claim.take(base, WRITING)
    assert json.loads(fs.cat(f"{root}/{WRITING}")) == live  # untouched
    fs.pipe(f"{root}/{WRITING}", json.dumps({**live, "refreshed": now - claim.STALE_S - 5}).encode())
    taken = claim.take(base, WRITING)
    assert json.loads(fs.cat(f"{root}/{WRITING}"))["pid"] == os.getpid() and taken.held()
    taken.release()
    assert not fs.exists(f"{root}/{WRITING}")


def test_a_store_that_takes_xb_without_enforcing_it_still_refuses_a_second_save():
    """fsspec's ftp and webhdfs take mode "xb" and write over what is there: a save trusting the exclusive
    create took the path from a live save.  The marker is asked first."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class Lax(MemoryFileSystem):  # "xb" taken as "wb", as those stores do
        protocol = "laxclaim"
        store, pseudo_dirs = {}, [""]

        def _open(self, path, mode="rb", **kwargs):
            return super()._open(path, mode.replace("x", "w"), **kwargs)

    fsspec.register_implementation("laxclaim", Lax, clobber=True)
    base = f"laxclaim://claim-lax-{os.getpid()}"
    fs, root = fsspec.core.url_to_fs(base)
    fs.makedirs(root, exist_ok=True)
    first = claim.take(base, WRITING)
    try:
        with pytest.raises(claim.PathBusy, match=f"pid {os.getpid()}"):
            claim.take(base, WRITING)
        assert first.held()
    finally:
        first.release()


def test_a_file_url_claim_is_refreshed_as_a_local_file_never_read_empty(tmp_path, monkeypatch):
    """Through a ``file://`` URL the refresh rewrote the marker with fsspec's "wb" (truncated in place): a second
    save reading it meanwhile found it empty -- an interrupted save's, taken over from a live one."""
    monkeypatch.setattr(claim, "REFRESH_S", 0.001)
    held = claim.take(f"file://{tmp_path}", WRITING)
    seen, deadline = set(), time.monotonic() + 1.5
    try:
        while time.monotonic() < deadline:
            try:
                data = (tmp_path / WRITING).read_bytes()
            except FileNotFoundError:
                data = b"<missing>"
            seen.add("ok" if data.startswith(b"{") and data.endswith(b"}") else repr(data[:20]))
        assert seen == {"ok"}, seen
        with pytest.raises(claim.PathBusy):
            claim.take(f"file://{tmp_path}", WRITING)
    finally:
        held.release()
    assert not (tmp_path / WRITING).exists()
