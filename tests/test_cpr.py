"""The CPR checkpointing baselines (``baselines/``) on real server processes on 127.0.0.1.

- ``full``: a failure ends with the same state, bit for bit, as a failure-free run (the
  rollback restores the last consistent cut and the worker replays from its step);
- ``cpr`` / ``cpr-mfu``: the failed shard equals its checkpoint (plus MFU deltas) plus the
  updates after recovery, the survivors lose nothing, and the lost-update count is exact;
- ``cpr`` with ``recovery=auto`` and a tiny PLS target: the overhead model picks full recovery;
- ``cpr-mfu`` saves hot rows more often than cold ones; ``cpr-ssu`` keeps its sample bounded;
- a corrupted or torn checkpoint is refused with an error naming the file;
- option validation, and the storage layer through fsspec.
"""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest
import torch

from baselines import storage
from baselines.cpr import FullCheckpoint, PartialRecovery, PartialRecoveryMFU, PartialRecoverySSU
from baselines.driver import CheckpointDriver
from ecrec.tables import optim
from ecrec.client import Cluster, ClusterError, EmbeddingBag
from ecrec.tables.spec import TableSpec, initial_payload
from ecrec.wire import cluster_pb2

ROWS, DIM, BATCH = 90, 4, 10
TABLE = dict(optimizer="adagrad", lr=0.1, eps=1e-8, initial_accumulator_value=0.1, seed=3)


def spec() -> TableSpec:
    return TableSpec("t", ROWS, DIM, **TABLE)


def connect(lc, rows: int = ROWS) -> tuple[Cluster, EmbeddingBag]:
    """Connects and creates table ``t`` (at once: a server that has not read its Register reply yet asks the
    coordinator for its index, ``tests/test_startup.py``)."""
    c = Cluster.connect(lc.coordinator_address)
    c.create_table("t", rows, DIM, **TABLE)
    return c, EmbeddingBag(c, "t")


def make_batches(steps: int, seed: int = 0, hot: int = 0, rows: int = ROWS, batch: int = BATCH):
    """Per step: distinct ids (``hot`` of them from ``[0, hot)`` every step) and a weight per id."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        cold = rng.choice(np.arange(hot, rows), batch - hot, replace=False)
        ids = np.concatenate([np.arange(hot), cold]).astype(np.int64)
        out.append((ids, rng.standard_normal((batch, DIM)).astype(np.float32)))
    return out


def train_step(cluster: Cluster, bag: EmbeddingBag, ids: np.ndarray, w: np.ndarray) -> dict:
    """One bag per id, ``loss = sum(bag * w)``: the gradient of row ``ids[i]`` is exactly ``w[i]``."""
    out = bag(torch.from_numpy(ids), torch.arange(len(ids)))
    (out * torch.from_numpy(w)).sum().backward()
    return cluster.step()


def simulate(state: np.ndarray, batches, only: np.ndarray | None = None) -> np.ndarray:
    """Applies ``batches`` to a local copy of the table payload, like the server does (optionally only rows in ``only``)."""
    state = state.copy()
    s = spec()
    for ids, w in batches:
        keep = np.ones(len(ids), bool) if only is None else np.isin(ids, only)
        order = np.argsort(ids[keep])
        rid, g = ids[keep][order], w[keep][order]
        rows = state[rid]
        optim.apply(s.optimizer, rows, g, s.dim, s.lr, s.eps)
        state[rid] = rows
    return state


def owned_by(cluster: Cluster, index: int) -> np.ndarray:
    servers, _ = cluster.layout.locate(np.arange(ROWS))
    return np.flatnonzero(servers == index)


def read_delta_ids(root: str, index: int) -> list[np.ndarray]:
    st = storage.Storage.open(root)
    return [storage.load_checkpoint(st, e.dirname).tables["t"].ids
            for e in storage.scan(st, index) if e.delta is not None and e.complete]


# --- full: rollback and replay -----------------------------------------------------------------------------

class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.lin = torch.nn.Linear(DIM, 2)


def run_full_model(make_cluster, strategy: str, options: dict, batches, kill_after: int | None):
    lc = make_cluster(servers=2, standby=1 if kill_after is not None else 0, strategy=strategy, options=options,
                      health_interval_s=0.2)
    c, bag = connect(lc)
    head = Head()
    c.register_dense(head, optimizer="sgd", lr=0.05, prefix="head.")
    driver = CheckpointDriver(c) if strategy != "none" else None
    if driver:
        driver.start(0)
    step, executed = 0, 0
    while step < len(batches):
        ids, w = batches[step]
        out = head.lin(bag(torch.from_numpy(ids), torch.arange(len(ids))))
        (out * torch.from_numpy(w[:, :2])).sum().backward()
        result = c.step()
        executed += 1
        resume = driver.after_step(step, result) if driver else None
        if step == kill_after and executed == step + 1:  # kill once, between steps, once the last cut is on disk
            c.strategy_call("flush")
            lc.kill(lc.pid_of_index(c.layout.dense_servers("head.lin.weight")[0]))
        step = resume if resume is not None else step + 1
    ids, payload = c.read_payload("t")
    dense = {n: c.read_dense_payload(n) for n in ("head.lin.weight", "head.lin.bias")}
    params = {n: p.detach().numpy().copy() for n, p in head.named_parameters()}
    return payload, dense, params, driver, executed


@pytest.mark.cluster
def test_full_failure_equals_failure_free_replay(make_cluster, tmp_path):
    batches = make_batches(14, seed=1)
    ref_payload, ref_dense, ref_params, _, _ = run_full_model(make_cluster, "none", {}, batches, None)
    options = {"dir": str(tmp_path / "ckpt"), "interval_steps": 4}
    payload, dense, params, driver, executed = run_full_model(make_cluster, "full", options, batches, kill_after=9)

    # saves after steps 3 and 7 (cuts at steps 4 and 8); the failure is seen after step 10: back to 8
    [event] = driver.events
    assert event.recovery == "full" and event.resume_step == 8 and event.step == 10
    assert driver.steps_redone == 3 and executed == len(batches) + 3
    assert event.updates_rolled_back == 3 * BATCH  # steps 8, 9, 10 were undone
    np.testing.assert_array_equal(payload.view(np.uint32), ref_payload.view(np.uint32))
    for name in ref_dense:
        np.testing.assert_array_equal(dense[name].view(np.uint32), ref_dense[name].view(np.uint32))
    for name in ref_params:
        np.testing.assert_array_equal(params[name], ref_params[name])
    # real files: every server has complete checkpoints with a manifest that lists checksums
    st = storage.Storage.open(options["dir"])
    for index in (0, 1):
        complete = [e for e in storage.scan(st, index) if e.complete]
        assert complete, f"server {index} has no complete checkpoint"
        manifest = storage.read_manifest(st, complete[-1].dirname)
        assert manifest["tables"][0]["sha256"] and manifest["kind"] == "full"


# --- cpr, cpr-mfu, cpr-ssu: partial recovery, exact loss ---------------------------------------------------------

def start_partial(make_cluster, strategy: str, root: str):
    """Two servers and a standby of a ``cpr*`` strategy whose timers never fire (saves are commanded; MFU saves
    a tenth of the rows, SSU samples 4), table ``t`` and a started driver."""
    options = {"dir": root, "interval_s": 3600}
    if strategy == "cpr-mfu":
        options.update(mfu_fraction=0.1, mfu_interval_s=3600)
    if strategy == "cpr-ssu":
        options.update(ssu_sample=4, ssu_interval_s=3600)
    lc = make_cluster(servers=2, standby=1, strategy=strategy, options=options, health_interval_s=0.2)
    c, bag = connect(lc)
    driver = CheckpointDriver(c)
    driver.start(0)
    return lc, c, bag, driver


@pytest.mark.cluster
@pytest.mark.parametrize("strategy", ["cpr", "cpr-mfu", "cpr-ssu"])
def test_partial_recovery_exact(make_cluster, tmp_path, strategy):
    root = str(tmp_path / "ckpt")
    lc, c, bag, driver = start_partial(make_cluster, strategy, root)
    assert driver.mode == "partial"
    batches = make_batches(16, seed=2, hot=3)
    failed = 1
    mine = owned_by(c, failed)

    for step, (ids, w) in enumerate(batches):
        result = train_step(c, bag, ids, w)
        assert driver.after_step(step, result) is None  # partial recovery never rewinds the worker
        if step == 4:
            driver.save_now(5, wait=True)  # base checkpoint: state after 5 steps
        if step == 7 and strategy in ("cpr-mfu", "cpr-ssu"):
            reply = c.strategy_call("save", {"kind": "partial", "wait": True}, indices=[failed])[failed]
            # ceil(0.1 * 45) rows at most (MFU); the sample of at most 4 rows (SSU)
            assert reply["kind"] == "partial" and 0 < reply["rows"] <= (5 if strategy == "cpr-mfu" else 4)
        if step == 10:
            lc.kill(lc.pid_of_index(failed))

    init = initial_payload(spec(), np.arange(ROWS))
    at_ckpt = simulate(init, batches[:5])
    full_run = simulate(init, batches)
    delta_ids = np.concatenate(read_delta_ids(root, failed) or [np.zeros(0, np.int64)])
    restored = at_ckpt.copy()
    if len(delta_ids):
        restored[delta_ids] = simulate(init, batches[:8])[delta_ids]
    expected_failed = simulate(restored, batches[11:], only=mine)

    _, payload = c.read_payload("t")
    survivors = np.setdiff1d(np.arange(ROWS), mine)
    np.testing.assert_array_equal(payload[survivors].view(np.uint32), full_run[survivors].view(np.uint32))
    np.testing.assert_array_equal(payload[mine].view(np.uint32), expected_failed[mine].view(np.uint32))

    # lost: the failed shard's row updates of steps 5..10, minus those the delta captured (steps 5..7)
    lost = sum(int(np.isin(ids, mine).sum()) for ids, _ in batches[5:11])
    lost -= sum(int(np.isin(ids, delta_ids).sum()) for ids, _ in batches[5:8])
    [event] = driver.events
    assert event.indices == [failed] and event.recovery == "partial"
    assert event.lost_updates == lost == driver.lost_updates
    assert driver.rows_acked_total == len(batches) * BATCH
    assert driver.pls() == pytest.approx(lost / (len(batches) * BATCH))
    assert driver.lost_now() == lost  # nothing more lost since
    assert event.restored[failed]["cut"] == 2  # the base saved after step 4
    if strategy == "cpr":
        assert len(delta_ids) == 0 and event.restored[failed]["deltas"] == []
    else:  # the partial save after step 7 is a delta on the base: it cut the loss by exactly its rows' updates
        assert len(delta_ids) > 0 and event.restored[failed]["deltas"] == [1]
        assert lost < sum(int(np.isin(ids, mine).sum()) for ids, _ in batches[5:11])
    if strategy == "cpr-mfu":
        assert set(np.arange(3)) & set(mine) <= set(delta_ids)  # the hot rows of that shard were in the delta
    if strategy == "cpr-ssu":
        assert len(delta_ids) <= 4 and set(delta_ids) <= set(mine)
    stats = c.strategy_call("stats")
    # the base restored is the save after step 4: sequence 2 after the initial save (1) of driver.start
    assert stats[failed]["loads"] == 1 and stats[failed]["restored"]["seq"] == 2
    assert stats[1 - failed]["saves"] == 2 and stats[1 - failed]["bytes_written"] > 0


@pytest.mark.cluster
def test_rows_written_and_warm_started_while_the_driver_counts_are_counted_as_updates(make_cluster, tmp_path):
    """``write_rows`` or a warm start (``create_table(init=...)``) after ``driver.start``: the servers count their rows
    as updates their state reflects, the driver did not (it counts steps' rows): the next failure raised 'servers
    reflect more row updates than were acknowledged' (training stopped, pointing at the wrong cause), or, when
    other losses hid the surplus, counted fewer lost updates than were lost.  They are acknowledged updates now,
    lost and counted with their shard."""
    root = str(tmp_path / "ckpt")
    lc, c, bag, driver = start_partial(make_cluster, "cpr", root)
    failed = 1
    mine = owned_by(c, failed)
    batches = make_batches(6, seed=5)
    for step, (ids, w) in enumerate(batches[:3]):
        assert driver.after_step(step, train_step(c, bag, ids, w)) is None
    driver.save_now(3, wait=True)  # the base the failed shard comes back to
    written = np.arange(0, ROWS, 3)  # rows of both shards
    c.write_rows("t", written, np.full((len(written), DIM), 42.0, np.float32))
    c.create_table("w", ROWS, DIM, optimizer="sgd", lr=0.1, init=torch.full((ROWS, DIM), 7.0))  # a warm start
    for step, (ids, w) in enumerate(batches[3:5], start=3):
        assert driver.after_step(step, train_step(c, bag, ids, w)) is None
    lc.kill(lc.pid_of_index(failed))
    ids, w = batches[5]
    assert driver.after_step(5, train_step(c, bag, ids, w)) is None  # (raised CheckpointError before)
    on_failed_w = int((c.layout.locate(np.arange(ROWS))[0] == failed).sum())  # "w" has the same rows as "t"
    lost = (int(np.isin(written, mine).sum()) + on_failed_w
            + sum(int(np.isin(ids, mine).sum()) for ids, _ in batches[3:5]))
    [event] = driver.events
    assert event.lost_updates == lost == driver.lost_updates, (event.lost_updates, lost)
    assert driver.rows_acked_total == 6 * BATCH + len(written) + ROWS
    assert driver.lost_now() == lost


@pytest.mark.cluster
def test_a_new_cluster_reusing_a_checkpoint_directory_never_restores_an_earlier_ones_rows(make_cluster, tmp_path):
    """The newest complete checkpoint was chosen by sequence number alone: a new job on the directory of an earlier
    one (same table) that lost a server before its own first save restored the earlier job's rows, silently.  A
    checkpoint names the cluster that saved it now; another cluster's is never restored (and is named in the log)."""
    root = str(tmp_path / "ckpt")
    lc, c, bag, driver = start_partial(make_cluster, "cpr", root)
    for step, (ids, w) in enumerate(make_batches(4, seed=6)):
        assert driver.after_step(step, train_step(c, bag, ids, w)) is None
    driver.save_now(4, wait=True)
    c.close()
    lc.close()

    lc = make_cluster(servers=2, standby=1, strategy="cpr", options={"dir": root, "interval_s": 3600},
                      health_interval_s=0.2)
    c, bag = connect(lc)  # the same table, at the same initial values; no driver, no save of its own yet
    listed = c.strategy_call("list")  # no cut of this cluster: a rollback could not pick the earlier job's
    assert all(r["cuts"] == [] and r["complete"] == [] and r["foreign"] for r in listed.values()), listed
    failed = 1
    mine = owned_by(c, failed)
    before = c.read_payload("t")[1].copy()
    lc.kill(lc.pid_of_index(failed))
    c.pull("t", mine)  # waits for the replacement
    after = c.read_payload("t")[1]
    init = initial_payload(spec(), np.arange(ROWS))
    np.testing.assert_array_equal(after[mine].view(np.uint32), init[mine].view(np.uint32))
    np.testing.assert_array_equal(after.view(np.uint32), before.view(np.uint32))  # nothing of the earlier job
    assert any("holds checkpoints of another cluster" in line for p in lc.server_procs
               for line in lc.stderr_tail(p.pid)), "the earlier job's checkpoints named in the log"


@pytest.mark.cluster
@pytest.mark.parametrize("recovery", ["auto", "full"])
def test_cpr_with_full_recovery_rolls_back_exactly(make_cluster, tmp_path, recovery):
    """``recovery=auto`` with target PLS 1e-9 (a save every ~14 us) makes the model pick full recovery at
    Daly's interval; ``recovery=full`` asks for it.  Either way a failure rolls every server back."""
    options = {"dir": str(tmp_path / "ckpt")}
    options.update({"mtbf_s": 3600, "target_pls": 1e-9} if recovery == "auto"
                   else {"interval_s": 3600, "recovery": "full"})
    lc = make_cluster(servers=2, standby=1, strategy="cpr", options=options, health_interval_s=0.2)
    c, bag = connect(lc)
    driver = CheckpointDriver(c, interval_steps=3)  # explicit steps win over the modelled seconds
    report = driver.start(0)
    assert report["mode"] == "full"
    if recovery == "auto":
        assert report["plan"]["recovery"] == "full"
        assert report["plan"]["partial_overhead"] > report["plan"]["full_overhead"]
        assert report["o_save_s"] > 0 and report["o_load_s"] > 0
    assert all(s["mode"] == "full" for s in c.strategy_call("stats").values())
    batches = make_batches(9, seed=6)
    step, killed = 0, False
    while step < len(batches):
        resume = driver.after_step(step, train_step(c, bag, *batches[step]))
        if step == 4 and not killed:
            c.strategy_call("flush")
            lc.kill(lc.pid_of_index(0))
            killed = True
        step = resume if resume is not None else step + 1
    [event] = driver.events
    assert event.recovery == "full" and event.step == 5 and event.resume_step == 3
    # every step was redone after the rollback: the table is exactly the failure-free result
    _, payload = c.read_payload("t")
    expected = simulate(initial_payload(spec(), np.arange(ROWS)), batches)
    np.testing.assert_array_equal(payload.view(np.uint32), expected.view(np.uint32))
    assert c.strategy_call("stats", indices=[0])[0]["mode"] == "full"  # the replacement was told too


@pytest.mark.cluster
def test_full_keeps_only_the_newest_checkpoints(make_cluster, tmp_path):
    """``keep=2``: after six cuts each server holds the two newest complete ones and the newest cut every server
    had confirmed when the last save started; older ones are deleted."""
    root = str(tmp_path / "ckpt")
    lc = make_cluster(servers=2, strategy="full", options={"dir": root, "interval_steps": 2, "keep": 2})
    c, bag = connect(lc)
    driver = CheckpointDriver(c)
    driver.start(0)  # cut 1
    for step, (ids, w) in enumerate(make_batches(10, seed=8)):
        driver.after_step(step, train_step(c, bag, ids, w))  # cuts 2..6 after steps 1, 3, 5, 7, 9
        c.strategy_call("flush")  # each write done before the next save: the cut confirmed then is known
    # the save of cut n passes the cut confirmed on every server at the save before (n - 2), which is never
    # deleted: cut 6 keeps the newest two (5, 6) and cut 4; cuts 1-3 are gone
    st = storage.Storage.open(root)
    stats = c.strategy_call("stats")
    for index in (0, 1):
        entries = storage.scan(st, index)
        assert [(e.seq, e.complete) for e in entries] == [(4, True), (5, True), (6, True)], entries
        assert [storage.read_manifest(st, e.dirname)["cut"] for e in entries] == [4, 5, 6]
        assert sorted(os.listdir(os.path.join(root, f"server-{index}"))) == [f"ckpt-0000000{n}" for n in (4, 5, 6)]
        assert stats[index]["saves"] == 6 and stats[index]["pruned"] == 3


# --- none: no fault tolerance ------------------------------------------------------------------------------------

@pytest.mark.cluster
def test_none_replacement_starts_from_initial_values(make_cluster):
    """Strategy ``none``: the replacement of a failed server serves its rows from their initial values; the
    updates before the failure are gone, those after it apply; the survivors lose nothing."""
    lc = make_cluster(servers=2, standby=1, strategy="none", health_interval_s=0.2)
    c, bag = connect(lc)
    batches = make_batches(12, seed=9)
    failed = 1
    mine = owned_by(c, failed)
    for step, (ids, w) in enumerate(batches):
        if step == 6:
            lc.kill(lc.pid_of_index(failed))
        train_step(c, bag, ids, w)  # the training loop sees no exception
    init = initial_payload(spec(), np.arange(ROWS))
    expected = simulate(init, batches)
    expected[mine] = simulate(init, batches[6:])[mine]
    assert any(np.isin(ids, mine).any() for ids, _ in batches[:6])  # something was there to lose
    _, payload = c.read_payload("t")
    np.testing.assert_array_equal(payload.view(np.uint32), expected.view(np.uint32))
    assert [e.index for e in c.refresh_map().events if e.kind == "promoted"] == [failed]


# --- MFU and SSU ----------------------------------------------------------------------------------------------------

@pytest.mark.cluster
def test_mfu_saves_hot_rows_more_often(make_cluster, tmp_path):
    root = str(tmp_path / "ckpt")
    lc = make_cluster(servers=2, strategy="cpr-mfu",
                      options={"dir": root, "interval_s": 3600, "mfu_interval_s": 3600, "mfu_fraction": 0.1})
    rows, hot = 200, 8
    c, bag = connect(lc, rows)
    driver = CheckpointDriver(c)
    driver.start(0)
    batches = make_batches(16, seed=3, hot=hot, rows=rows, batch=16)
    for step, (ids, w) in enumerate(batches):
        driver.after_step(step, train_step(c, bag, ids, w))
        if step % 4 == 3:
            c.strategy_call("save", {"kind": "partial", "wait": True})
    saved = np.zeros(rows, int)
    for index in (0, 1):
        deltas = read_delta_ids(root, index)
        assert len(deltas) == 4
        for d in deltas:
            assert len(d) <= 10  # ceil(0.1 * 100 owned rows)
            saved[d] += 1
    assert (saved[:hot] == 4).all(), saved[:hot]  # every hot row in every partial save
    cold = saved[hot:]
    assert cold.max() < 4 and cold.mean() < 1
    stats = c.strategy_call("stats")
    assert all(s["partial_saves"] == 4 and s["rows_saved_partial"] <= 40 for s in stats.values())


@pytest.mark.cluster
def test_ssu_sample_stays_bounded(make_cluster, tmp_path):
    root = str(tmp_path / "ckpt")
    cap = 5
    lc = make_cluster(servers=2, strategy="cpr-ssu",
                      options={"dir": root, "interval_s": 3600, "ssu_sample": cap, "ssu_interval_s": 0.25})
    c, bag = connect(lc)
    driver = CheckpointDriver(c)
    driver.start(0)
    # trains until the timer (every 0.25 s) did two partial saves on every server: no step count or time is
    # assumed (a stuck timer ends at the test's timeout)
    for step in itertools.count():
        ids, w = make_batches(1, seed=4 + step)[0]
        driver.after_step(step, train_step(c, bag, ids, w))
        if step % 10 == 9 and all(s["partial_saves"] >= 2 for s in c.strategy_call("stats").values()):
            break
    c.strategy_call("flush")
    stats = c.strategy_call("stats")
    for index, s in stats.items():
        assert s["ssu_sample_max"] == cap  # filled, never beyond
        assert s["partial_saves"] >= 2, s  # the timer drives them
        assert s["rows_saved_partial"] <= cap * s["partial_saves"]
        for d in read_delta_ids(root, index):
            assert 0 < len(d) <= cap
    # a full restore (base + deltas) of a live server verifies and applies
    info = c.strategy_call("restore", {}, indices=[0])[0]
    assert info["deltas"] and info["seq"] == 1


# --- corruption ---------------------------------------------------------------------------------------------------------

@pytest.mark.cluster
def test_corrupted_checkpoint_is_refused(make_cluster, tmp_path):
    root = str(tmp_path / "ckpt")
    lc = make_cluster(servers=2, strategy="full", options={"dir": root, "interval_steps": 100})
    c, bag = connect(lc)
    driver = CheckpointDriver(c)
    driver.start(0)
    batches = make_batches(3, seed=5)
    for step, (ids, w) in enumerate(batches):
        driver.after_step(step, train_step(c, bag, ids, w))
    driver.save_now(3, wait=True)  # cut 2
    _, before = c.read_payload("t")

    # server 0: flip one byte of its table file -> checksum mismatch naming the file
    path = os.path.join(root, "server-0", "ckpt-00000002", "table-000.bin")
    with open(path, "r+b") as f:
        f.seek(20)
        b = f.read(1)
        f.seek(20)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ClusterError, match=r"DATA_LOSS: CheckpointCorrupt: .*table-000\.bin is corrupt: sha256"):
        c.strategy_call("restore", {"cut": 2}, indices=[0])
    # server 1: a torn checkpoint (no manifest) is not a complete cut and is not loaded
    os.remove(os.path.join(root, "server-1", "ckpt-00000002", storage.MANIFEST))
    assert c.strategy_call("list", indices=[1])[1]["cuts"] == [1]
    with pytest.raises(ClusterError, match="no complete checkpoint of cut 2"):
        c.strategy_call("restore", {"cut": 2}, indices=[1])
    with pytest.raises(ClusterError, match="FAILED_PRECONDITION: CheckpointIncomplete: .*no MANIFEST.json.*torn"):
        c.strategy_call("restore", {"seq": 2}, indices=[1])
    # nothing was applied by the refused restores
    _, after = c.read_payload("t")
    np.testing.assert_array_equal(after.view(np.uint32), before.view(np.uint32))
    # an intact older cut still restores
    info = c.strategy_call("restore", {"cut": 1})
    assert {r["step"] for r in info.values()} == {0}
    _, restored = c.read_payload("t")
    np.testing.assert_array_equal(restored.view(np.uint32), initial_payload(spec(), np.arange(ROWS)).view(np.uint32))


@pytest.mark.cluster
def test_a_replacement_whose_newest_checkpoint_is_corrupt_restores_the_next_older_one(make_cluster, tmp_path):
    """A corrupt newest checkpoint (one flipped byte) refused every standby promoted into the index, the coordinator
    retrying twice a second without end and the training step hanging until its deadline, while an intact older
    checkpoint sat beside it.  The replacement restores that one, names the corrupt one, and the loss is counted
    exactly from what it applied."""
    root = str(tmp_path / "ckpt")
    lc, c, bag, driver = start_partial(make_cluster, "cpr", root)  # the initial save: seq 1
    failed = 1
    mine = owned_by(c, failed)
    batches = make_batches(6, seed=7)
    for step, (ids, w) in enumerate(batches[:3]):
        assert driver.after_step(step, train_step(c, bag, ids, w)) is None
    driver.save_now(3, wait=True)  # seq 2, corrupted below
    for step, (ids, w) in enumerate(batches[3:5], start=3):
        assert driver.after_step(step, train_step(c, bag, ids, w)) is None
    path = os.path.join(root, f"server-{failed}", "ckpt-00000002", "table-000.bin")
    with open(path, "r+b") as f:
        f.seek(20)
        b = f.read(1)
        f.seek(20)
        f.write(bytes([b[0] ^ 0xFF]))
    lc.kill(lc.pid_of_index(failed))
    ids, w = batches[5]
    assert driver.after_step(5, train_step(c, bag, ids, w)) is None  # (hung until the retry deadline before)
    [event] = driver.events
    assert event.restored[failed]["seq"] == 1 and event.restored[failed]["corrupt"] == [
        f"server-{failed}/ckpt-00000002"]
    lost = sum(int(np.isin(ids, mine).sum()) for ids, _ in batches[:5])  # back to the initial save
    assert event.lost_updates == lost == driver.lost_updates
    init = initial_payload(spec(), np.arange(ROWS))
    expected = simulate(init, batches[5:], only=mine)
    np.testing.assert_array_equal(c.read_payload("t")[1][mine].view(np.uint32), expected[mine].view(np.uint32))


@pytest.mark.cluster
def test_a_checkpoint_directory_that_cannot_be_written_is_a_failed_precondition_naming_it(make_cluster, tmp_path):
    """A ``dir`` under a regular file was answered INTERNAL, each server logging a traceback."""
    (tmp_path / "afile").write_text("not a directory")
    root = str(tmp_path / "afile" / "ck")
    lc = make_cluster(servers=2, strategy="cpr", options={"dir": root, "interval_s": 3600})
    c, _ = connect(lc)
    with pytest.raises(ClusterError, match=r"FAILED_PRECONDITION: [a-z]+: the checkpoint storage .*afile/ck: "
                                           r"NotADirectoryError"):
        CheckpointDriver(c).start(0)
    assert not any("Traceback" in line for p in lc.server_procs for line in lc.stderr_tail(p.pid))


@pytest.mark.cluster
def test_a_new_driver_does_not_inherit_an_earlier_drivers_interval(make_cluster, tmp_path):
    """``configure(interval_s=...)`` of one driver outlived it: a later driver on the same cluster ran with the
    servers still on the earlier interval (and a replacement on the option's)."""
    lc = make_cluster(servers=2, strategy="cpr", options={"dir": str(tmp_path / "ckpt"), "interval_s": 2})
    c, _ = connect(lc)
    first = CheckpointDriver(c, recovery="partial")
    first.start(0)
    first.configure(interval_s=3600)
    assert {r["interval_s"] for r in c.strategy_call("configure", {}).values()} == {3600.0}
    CheckpointDriver(c, recovery="partial").start(0)
    assert {r["interval_s"] for r in c.strategy_call("configure", {}).values()} == {2.0}


@pytest.mark.cluster
def test_a_failure_no_push_met_is_counted_by_the_report(make_cluster, tmp_path):
    """A server killed after the last step that touched it: ``after_step`` of steps that reach only the survivors
    saw nothing (the client's map still named the dead server), and ``report()`` said 0 updates lost while
    ``lost_now()`` said how many."""
    from helpers import wait_for

    lc, c, bag, driver = start_partial(make_cluster, "cpr", str(tmp_path / "ckpt"))
    failed = 1
    mine = owned_by(c, failed)
    theirs = np.setdiff1d(np.arange(ROWS), mine)
    batches = make_batches(3, seed=8)
    for step, (ids, w) in enumerate(batches):
        assert driver.after_step(step, train_step(c, bag, ids, w)) is None
    holder = lambda: next(s for s in lc.cluster_map().servers if s.index == failed)
    before = holder().server_id
    lc.kill(lc.pid_of_index(failed))
    wait_for(lambda: holder().server_id != before and holder().state == cluster_pb2.ACTIVE, 60, "the standby promoted")
    ids = theirs[:BATCH]  # a step that reaches the survivor only
    assert driver.after_step(3, train_step(c, bag, ids, np.ones((len(ids), DIM), np.float32))) is None
    lost = sum(int(np.isin(ids, mine).sum()) for ids, _ in batches)
    report = driver.report()
    assert report["lost_updates"] == lost and len(report["failures"]) == 1, report
    assert driver.lost_now() == lost


# --- storage, unit level ---------------------------------------------------------------------------------------------

def _snapshot(seq=1, delta=None):
    ids = np.array([3, 5, 9], dtype=np.int64)
    payload = np.arange(3 * 16, dtype=np.uint8).reshape(3, 16)
    t = storage.TableSnapshot("t", {"num_rows": 10, "dim": 2, "optimizer": "adagrad", "row_bytes": 16}, ids, payload,
                              row_updates=7, counts=np.array([1, 2, 3]) if delta else None)
    return storage.Snapshot(0, seq, "delta" if delta else "full", "cpr", tables=[t],
                            dense=[storage.DenseSnapshot("w", np.arange(4, dtype=np.float32))], delta=delta, cut=4, step=9)


@pytest.fixture
def memory_url():
    """A fresh ``memory://`` root (fsspec's memory filesystem is process-global), removed even when the test fails."""
    import uuid

    import fsspec

    name = f"ecrec-test-{uuid.uuid4().hex[:12]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


@pytest.mark.parametrize("url", ["local", "memory", "file"])
def test_storage_round_trip_and_verification(tmp_path, url, memory_url):
    """One process writes and reads, so ``memory://`` is fine here (a strategy refuses it: see
    ``test_options_are_validated``)."""
    root = {"local": str(tmp_path), "file": f"file://{tmp_path}", "memory": memory_url}[url]
    st = storage.Storage.open(root)
    m = storage.write_checkpoint(st, _snapshot())
    storage.write_checkpoint(st, _snapshot(delta=1))
    assert m["bytes"] > 0
    base, deltas, skipped = storage.latest_chain(st, 0)
    assert base.seq == 1 and [d.delta for d in deltas] == [1] and not skipped
    ck = storage.load_checkpoint(st, base.dirname)
    assert ck.manifest["cut"] == 4 and ck.manifest["step"] == 9
    np.testing.assert_array_equal(ck.tables["t"].ids, [3, 5, 9])
    np.testing.assert_array_equal(ck.tables["t"].payload, _snapshot().tables[0].payload)
    np.testing.assert_array_equal(ck.dense["w"], np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(storage.load_checkpoint(st, deltas[0].dirname).tables["t"].counts, [1, 2, 3])

    # truncated data file
    data = st.read(f"{base.dirname}/table-000.bin")
    st.write_atomic(f"{base.dirname}/table-000.bin", [data[:-1]])
    with pytest.raises(storage.CheckpointCorrupt, match=r"table-000\.bin has .* bytes.*truncated"):
        storage.load_checkpoint(st, base.dirname)
    # same size, one byte flipped
    st.write_atomic(f"{base.dirname}/table-000.bin", [data[:-1] + bytes([data[-1] ^ 1])])
    with pytest.raises(storage.CheckpointCorrupt, match="sha256"):
        storage.load_checkpoint(st, base.dirname)
    # garbage manifest
    st.write_atomic(f"{deltas[0].dirname}/{storage.MANIFEST}", [b"{not json"])
    with pytest.raises(storage.CheckpointCorrupt, match="not valid JSON"):
        storage.load_checkpoint(st, deltas[0].dirname)
    # a torn checkpoint (no manifest) is skipped by the chain and refused when asked for
    st.write_atomic(f"{storage.checkpoint_dir(0, 2)}/table-000.bin", [b"partial"])
    base2, _, skipped = storage.latest_chain(st, 0)
    assert base2.seq == 1 and [e.seq for e in skipped] == [2]
    with pytest.raises(storage.CheckpointIncomplete, match="torn"):
        storage.load_checkpoint(st, storage.checkpoint_dir(0, 2))
    if url != "memory":  # no temporary files are left behind by the atomic writes
        leftovers = [f for _, _, files in os.walk(tmp_path) for f in files if f.startswith(".tmp-")]
        assert leftovers == []


# --- options ---------------------------------------------------------------------------------------------------------

def test_a_relative_checkpoint_directory_is_stored_absolute_one_for_every_server(tmp_path, monkeypatch):
    """``dir=ckpt`` went into the map as given, and each server resolved it in its own working directory: servers
    started from different directories checkpointed apart, and a replacement looked for the failed server's files
    where it had none.  The coordinator stores it absolute (in its own working directory), ``file://`` and
    ``local://`` URLs' relative paths too, ``~`` expanded; an absolute path or another URL is kept as given."""
    monkeypatch.chdir(tmp_path)
    for cls in (FullCheckpoint, PartialRecovery):
        stored = cls.layout_params(3, 0, 0, {"dir": "ckpt/run1", "interval_s": "30", "mtbf_s": "3600"})[2]
        assert stored["dir"] == str(tmp_path / "ckpt" / "run1") and stored["interval_s"] == "30"
    for given, want in (("file:///x/y", "file:///x/y"),
                        ("file://ckpt", f"file://{tmp_path}/ckpt"), ("local://./ckpt", f"local://{tmp_path}/ckpt"),
                        ("~/ckpt", os.path.expanduser("~/ckpt"))):
        assert FullCheckpoint.layout_params(3, 0, 0, {"dir": given, "mtbf_s": "9"})[2]["dir"] == want, given
    from baselines.options import _absolute_dir

    assert _absolute_dir("s3://bucket/ckpt") == "s3://bucket/ckpt"  # another store: as given
    monkeypatch.chdir("/")  # a second reading of the stored options (a restarted coordinator elsewhere) keeps it
    assert FullCheckpoint.layout_params(3, 0, 0, stored)[2]["dir"] == str(tmp_path / "ckpt" / "run1")


def test_options_are_validated(tmp_path):
    d = str(tmp_path)
    assert PartialRecovery.layout_params(4, 0, 0, {"dir": d, "interval_s": "30"}) == (4, 0, {"dir": d, "interval_s": "30"})
    assert FullCheckpoint.layout_params(3, 0, 0, {"dir": d, "mtbf_s": "3600"})[:2] == (3, 0)
    cases = [
        (PartialRecovery, {"interval_s": "30"}, "needs --option dir"),
        (PartialRecovery, {"dir": d}, "needs an interval"),
        (PartialRecovery, {"dir": d, "interval_s": "-1"}, r"interval_s='-1'.*> 0"),
        (PartialRecovery, {"dir": d, "interval_s": "soon"}, "not a number"),
        (PartialRecovery, {"dir": d, "interval_s": "30", "mfu_fraction": "0.1"}, "unknown option"),
        (PartialRecovery, {"dir": d, "target_pls": "2", "mtbf_s": "10"}, r"target_pls='2'.*< 1"),
        (PartialRecovery, {"dir": d, "interval_s": "5", "recovery": "auto"}, "needs mtbf_s and target_pls"),
        (PartialRecovery, {"dir": d, "interval_s": "5", "recovery": "maybe"}, "choose partial, full or auto"),
        (PartialRecoveryMFU, {"dir": d, "interval_s": "5", "mfu_fraction": "0"}, "mfu_fraction"),
        (PartialRecoverySSU, {"dir": d, "interval_s": "5", "ssu_sample": "0"}, "ssu_sample"),
        (FullCheckpoint, {"dir": d}, "needs an interval"),
        (FullCheckpoint, {"dir": d, "interval_s": "5", "keep": "1"}, "keep"),
        (FullCheckpoint, {"dir": d, "interval_s": "5", "target_pls": "0.1"}, "unknown option"),
        (FullCheckpoint, {"dir": "nosuchproto://x", "interval_s": "5"}, "nosuchproto"),
        # process-local filesystems: every server would see only its own writes (a replacement none)
        (FullCheckpoint, {"dir": "memory://ckpt", "interval_s": "5"},
         r"option dir='memory://ckpt': fsspec's memory filesystem lives inside one process, .* a replacement must "
         r"read the failed server's; use a directory or a URL every server reaches"),
        (PartialRecovery, {"dir": "simplecache::memory://ckpt", "interval_s": "5"}, "lives inside one process"),
    ]
    for cls, options, message in cases:
        with pytest.raises(ValueError, match=message):
            cls.layout_params(4, 0, 0, options)
    with pytest.raises(ValueError, match="keeps no parity"):
        PartialRecovery.layout_params(4, 0, 1, {"dir": d, "interval_s": "5"})
    # the partial interval follows from the PLS target: 2 * 0.01 * 4 * 3600
    opts = PartialRecovery.options_from({"dir": d, "target_pls": "0.01", "mtbf_s": "3600"})
    assert opts.recovery == "auto"


def test_the_drivers_own_intervals_are_checked_before_anything_runs():
    """``CheckpointDriver(interval_s=inf)`` (a save never due), ``interval_steps=2.5`` or ``True`` (which
    ``set_interval_steps`` refuses) were taken; ``interval_steps="5"`` was a TypeError comparing str and int."""
    for kwargs, said in [({"interval_s": float("inf")}, "interval_s must be a finite number of seconds > 0"),
                         ({"interval_s": float("nan")}, "interval_s must be"), ({"interval_s": "60"}, "interval_s"),
                         ({"mtbf_s": -1.0}, "mtbf_s must be"), ({"interval_steps": 2.5}, "interval_steps must be an "
                                                                                         "integer >= 1, got 2.5"),
                         ({"interval_steps": True}, "got True"), ({"interval_steps": "5"}, "got '5'"),
                         ({"interval_steps": 0}, "got 0")]:
        with pytest.raises(ValueError, match=said):
            CheckpointDriver(None, **kwargs)  # refused before the cluster is asked anything


def test_manifest_is_json_with_checksums(tmp_path):
    st = storage.Storage.open(str(tmp_path))
    storage.write_checkpoint(st, _snapshot())
    with open(os.path.join(tmp_path, "server-0", "ckpt-00000001", storage.MANIFEST)) as f:
        m = json.load(f)
    assert m["format"] == storage.FORMAT and m["tables"][0]["row_updates"] == 7
    assert {e["file"] for e in m["tables"] + m["dense"]} == {"table-000.bin", "dense-000.bin"}
    assert all(len(e["sha256"]) == 64 and e["size"] > 0 for e in m["tables"] + m["dense"])


def test_empty_chunks_are_written_and_hashed(tmp_path, memory_url):
    """A partial save can hold no rows of some table: empty arrays must not break writing or hashing."""
    import hashlib

    import numpy as np

    from baselines import storage as st

    chunks = [np.zeros(0, dtype=np.int64), np.arange(3, dtype=np.int64), np.zeros((0, 4), dtype=np.uint8)]
    expected = np.arange(3, dtype=np.int64).tobytes()
    for store in (st.LocalStorage(str(tmp_path / "local")), st.FsspecStorage(memory_url)):
        size, digest = store.write_atomic("x/empty.bin", chunks)
        assert (size, digest) == (24, hashlib.sha256(expected).hexdigest())
        assert store.read("x/empty.bin") == expected  # what was written is exactly the non-empty chunk
        assert st._hash_chunks(chunks) == (24, hashlib.sha256(store.read("x/empty.bin")).hexdigest())


# --- issue 24: the baselines as CPR runs them -------------------------------------------------------------------

@pytest.mark.cluster
@pytest.mark.parametrize("called_twice, written", [(False, False), (True, False), (False, True)])
def test_partial_recovery_keeps_the_dense_parameters(make_cluster, tmp_path, called_twice, written):
    """CPR keeps the dense model on its trainers: a partial recovery loses embedding rows only.  The driver's copy
    of the dense payloads (weights and Adagrad state) puts the failed server's dense tensors back as they were, so
    the servers' dense payloads end equal, bit for bit, to the initial ones advanced by every gradient pushed.
    ``called_twice``: a second ``after_step`` for one step (``result=None``, as the signature allows) applied that
    step's dense gradients to the copy again, and the recovery put the wrong weights back.  ``written``: a payload
    written (``write_dense``) while the driver counts is in the copy it puts back."""
    lc = make_cluster(servers=2, standby=1, strategy="cpr", options={"dir": str(tmp_path / "ckpt"), "interval_s": 3600},
                      health_interval_s=0.2)
    c, bag = connect(lc)
    head = Head()
    names = c.register_dense(head, optimizer="adagrad", lr=0.05, eps=1e-8, initial_accumulator_value=0.1,
                             prefix="head.")
    expected = {n: c.read_dense_payload(n)[None, :].copy() for n in names}
    specs = {n: c.dense_spec(n) for n in names}
    driver = CheckpointDriver(c)
    driver.start(0)  # the checkpoint a replacement restores: the dense tensors at their initial values
    assert driver.dense_copy is not None
    failed = c.layout.dense_servers("head.lin.weight")[0]
    batches = make_batches(12, seed=4)
    for step, (ids, w) in enumerate(batches):
        out = head.lin(bag(torch.from_numpy(ids), torch.arange(len(ids))))
        (out * torch.from_numpy(w[:, :2])).sum().backward()
        grads = {n: p.grad.detach().numpy().reshape(1, -1).copy() for n, p in
                 (("head." + k, v) for k, v in head.named_parameters())}
        result = c.step()
        for n, g in grads.items():
            optim.apply("adagrad", expected[n], g, specs[n].numel, specs[n].lr, specs[n].eps)
        assert driver.after_step(step, result) is None
        if called_twice and step == 3:
            assert driver.after_step(step, None) is None
        if written and step == 2:  # a warm start of the dense model between steps
            for n in names:
                expected[n][0] = np.linspace(-0.5, 0.5, expected[n].size, dtype=np.float32)
                expected[n][0, specs[n].numel:] = 0.25  # Adagrad's accumulators
                c.write_dense(n, expected[n][0])
        if step == 5:
            lc.kill(lc.pid_of_index(failed))
    [event] = driver.events
    on_failed = [n for n in names if c.layout.dense_servers(n)[0] == failed]
    assert event.recovery == "partial" and event.dense_kept == on_failed and event.dense_rolled_back == []
    for n in names:
        np.testing.assert_array_equal(c.read_dense_payload(n).view(np.uint32), expected[n][0].view(np.uint32))
    # without the copy (several workers push: no one worker's copy is exact) the tensors roll back, and say so
    assert CheckpointDriver(c, keep_dense=False).dense_copy is None


def test_a_packed_checkpoint_is_one_data_file_and_names_a_corrupt_record(tmp_path):
    st = storage.Storage.open(str(tmp_path))
    m = storage.write_checkpoint(st, _snapshot(), packed=True)
    d = storage.checkpoint_dir(0, 1)
    assert sorted(os.listdir(os.path.join(tmp_path, *d.split("/")))) == [storage.MANIFEST, storage.PACKED]
    assert {e["file"] for e in m["tables"] + m["dense"]} == {storage.PACKED}
    assert [e["offset"] for e in m["tables"] + m["dense"]] == [0, m["tables"][0]["size"]]
    ck = storage.load_checkpoint(st, d)
    np.testing.assert_array_equal(ck.tables["t"].ids, [3, 5, 9])
    np.testing.assert_array_equal(ck.dense["w"], np.arange(4, dtype=np.float32))
    data = bytearray(st.read(f"{d}/{storage.PACKED}"))
    data[-3] ^= 1  # inside the dense record, the last one
    os.remove(os.path.join(tmp_path, *d.split("/"), storage.PACKED))
    st.write_new(f"{d}/{storage.PACKED}", [bytes(data)])
    with pytest.raises(storage.CheckpointCorrupt, match=r"data\.bin \(record at offset \d+\) is corrupt: sha256"):
        storage.load_checkpoint(st, d)
    with pytest.raises(FileExistsError):  # the one data file is never written over
        st.write_new(f"{d}/{storage.PACKED}", [b"x"])


def test_a_bandwidth_cap_makes_writes_and_reads_take_their_share(tmp_path):
    inner = storage.Storage.open(str(tmp_path))
    capped = storage.Throttled(inner, bytes_per_s=2e6)
    import time

    t0 = time.perf_counter()
    capped.write_atomic("a/x.bin", [np.zeros(400_000, dtype=np.uint8)])
    t1 = time.perf_counter()
    assert capped.read("a/x.bin") == bytes(400_000)
    t2 = time.perf_counter()
    assert t1 - t0 >= 0.2 and t2 - t1 >= 0.2  # 400 kB at 2 MB/s each way, at least (sleeps are lower bounds)
    with pytest.raises(ValueError, match="bandwidth"):
        storage.Throttled(inner, 0)


@pytest.mark.cluster
def test_timer_saves_that_find_the_writer_busy_are_deferred_not_dropped(make_cluster, tmp_path):
    """A store capped at 5 kB/s makes every write (about 2 kB) slower than the 0.1 s timer interval: the timer keeps the save
    due and takes it when the write ends (``saves_deferred``), never drops one (``saves_skipped`` 0)."""
    options = {"dir": str(tmp_path / "ckpt"), "interval_s": 0.1, "bandwidth_mb_s": 0.005, "files": "one"}
    lc = make_cluster(servers=2, strategy="cpr", options=options)
    c, bag = connect(lc)
    import time

    for step, (ids, w) in enumerate(make_batches(40, seed=6)):
        train_step(c, bag, ids, w)
        time.sleep(0.03)
    stats = c.strategy_call("stats")
    for s in stats.values():
        assert s["saves_skipped"] == 0
        assert s["saves_deferred"] > 0 and s["saves"] >= 2, s
        assert s["redundancy_bytes"] == 0 < s["accounting_bytes"]  # plain cpr's mechanism keeps nothing per row
    entries = storage.scan(storage.Storage.open(options["dir"]), 0)
    # one data file and its manifest, no temporary name: a checkpoint being written (the timer goes on) holds
    # nothing yet, or its data file alone
    listings = [sorted(os.listdir(os.path.join(options["dir"], *e.dirname.split("/")))) for e in entries]
    assert all(names in ([storage.MANIFEST, storage.PACKED], [storage.PACKED], []) for names in listings), listings
    assert any(names == [storage.MANIFEST, storage.PACKED] for names in listings), listings


def test_the_memory_of_the_mechanism_is_mfus_counters_and_ssus_sample(tmp_path):
    """``redundancy_bytes`` counts what the mechanism needs: nothing for cpr, a counter per row for MFU, the
    bounded sample for SSU; the loss accounting's per-row counts are ``accounting_bytes``."""
    from baselines.cpr.account import TableAccount

    class Shard:
        num_slots = 1000
        owned_slots = np.arange(1000)
        owned_ids = np.arange(1000)

    plain, mfu, ssu = (TableAccount(Shard(), v, 64) for v in (None, "mfu", "ssu"))
    assert plain.nbytes == 0 and mfu.nbytes == 1000 * 8 and ssu.nbytes == 64 * 8
    assert plain.accounting_nbytes == 1000 * 8 and mfu.accounting_nbytes == ssu.accounting_nbytes == 3 * 1000 * 8


@pytest.mark.cluster
@pytest.mark.parametrize("strategy", ["cpr", "cpr-mfu"])
def test_the_lost_samples_weigh_each_lost_update_by_its_lookups(make_cluster, tmp_path, strategy):
    """CPR's PLS counts lost *samples*.  Batches here look hot rows up several times; the driver's sample-weighted
    count equals the lookups of exactly the updates lost: the failed shard's updates since its base, minus those a
    delta put back (the first ones of each saved row), minus those applied after the restore."""
    lc, c, bag, driver = start_partial(make_cluster, strategy, str(tmp_path / "ckpt"))
    rng = np.random.default_rng(11)
    batches = []
    for _ in range(14):  # ids with repeats: the three hot rows are looked up 1-4 times per batch
        ids = np.concatenate([np.repeat(np.arange(3), rng.integers(1, 5, size=3)), rng.choice(np.arange(3, ROWS), 6)])
        batches.append((ids.astype(np.int64), rng.standard_normal((len(ids), DIM)).astype(np.float32)))
    failed = 1
    mine = owned_by(c, failed)
    delta_step = 7
    for step, (ids, w) in enumerate(batches):
        result = train_step(c, bag, ids, w)
        assert driver.after_step(step, result) is None
        if step == 4:
            driver.save_now(5, wait=True)  # the base: after step 4
        if step == delta_step and strategy == "cpr-mfu":
            c.strategy_call("save", {"kind": "partial", "wait": True}, indices=[failed])
        if step == 10:
            lc.kill(lc.pid_of_index(failed))
    [event] = driver.events
    assert event.lost_samples is None and driver._pending_samples  # counted later, not in the recovery's time
    report = driver.report()  # settles the count
    assert report["failures"][0]["lost_samples"] == event.lost_samples is not None
    delta_ids = np.concatenate(read_delta_ids(str(tmp_path / "ckpt"), failed) or [np.zeros(0, np.int64)])

    def lookups(ids, rows):
        u, n = np.unique(ids, return_counts=True)
        return int(n[np.isin(u, rows)].sum())

    lost_rows = np.setdiff1d(mine, delta_ids)
    expected = sum(lookups(ids, mine) for ids, _ in batches[5:11]) - sum(
        lookups(ids, delta_ids) for ids, _ in batches[5:delta_step + 1])
    assert event.lost_samples == expected == driver.lost_samples
    assert lookups(np.concatenate([b[0] for b in batches[5:11]]), lost_rows) <= expected
    if strategy == "cpr-mfu":
        assert len(delta_ids) and expected < sum(lookups(ids, mine) for ids, _ in batches[5:11])
    assert driver.samples_acked == sum(len(ids) for ids, _ in batches)
    assert driver.pls_samples() == pytest.approx(expected / driver.samples_acked)
    assert driver.report()["pls_samples"] == driver.pls_samples()


def test_a_packed_checkpoint_through_fsspec_is_written_once_and_never_over(tmp_path):
    st = storage.Storage.open(f"file://{tmp_path}")
    m = storage.write_checkpoint(st, _snapshot(), packed=True)
    assert m["format"] == storage.FORMAT_PACKED
    ck = storage.load_checkpoint(st, storage.checkpoint_dir(0, 1))
    np.testing.assert_array_equal(ck.dense["w"], np.arange(4, dtype=np.float32))
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".tmp-")]  # no temporary name, no move
    with pytest.raises(FileExistsError, match="never written over"):
        st.write_new(f"{storage.checkpoint_dir(0, 1)}/{storage.PACKED}", [b"x"])


def test_the_bandwidth_cap_is_shared_by_concurrent_writes(tmp_path):
    import threading
    import time

    capped = storage.Throttled(storage.Storage.open(str(tmp_path)), bytes_per_s=1e6)
    threads = [threading.Thread(target=capped.write_atomic, args=(f"t/{i}.bin", [np.zeros(200_000, np.uint8)]))
               for i in range(4)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.perf_counter() - t0 >= 0.8  # 800 kB at 1 MB/s in all, not 200 kB each side by side
