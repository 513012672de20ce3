"""``ecrec-bench compare``: the quick preset end to end for two strategies, and its argument errors.

The runs here are smoke tests at a small size: the same code path as the README's main job, the quick preset's
shape (8 tables, 4 servers + a standby, RS(2, 1)) with fewer rows and samples; ``tiny_preset`` shrinks it further
for the launchers and data sets."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from ecrec.bench import cli, compare

REQUIRED = (
    "samples_per_s_failure_free", "overhead_vs_none", "recovery_s", "fully_redundant_s", "max_stall_s",
    "throughput_during_recovery_ratio", "lost_updates", "pls", "test_auc", "test_logloss",
    "state_matches_failure_free", "memory_overhead", "checkpoint_bytes", "network_bytes",
)


@pytest.fixture(autouse=True)
def small_quick(monkeypatch):
    """The quick preset with fewer rows and samples (a smoke test of its code path, not a measurement)."""
    monkeypatch.setitem(compare.PRESETS, "quick", dict(compare.PRESETS["quick"], rows_per_table=4000, samples=8000,
                                                        batch_size=128))


@pytest.mark.benchmark
@pytest.mark.cluster
def test_quick_none_and_ecrec(tmp_path):
    report_path, plot_path = tmp_path / "r.json", tmp_path / "p.png"
    rc = cli.main(["compare", "--strategies", "none,ecrec", "--steps", "40", "--fail-at", "20",
                   "--json", str(report_path), "--plot", str(plot_path)])
    assert rc == 0
    report = json.loads(report_path.read_text())
    assert report["config"]["steps"] == 40 and report["config"]["fail_at"] == 20
    assert report["config"]["strategies"] == ["none", "ecrec"]
    # the DLRM: TorchRec's when the torchrec extra is installed (--model auto), ours otherwise
    assert report["config"]["model"] == ("torchrec" if importlib.util.find_spec("torchrec") else "ecrec")
    assert set(report["strategies"]) == {"none", "ecrec"}
    for name, row in report["strategies"].items():
        missing = [key for key in REQUIRED if key not in row]
        assert not missing, f"{name}: missing {missing}"
        assert row["samples_per_s_failure_free"] > 0
        assert row["checkpoint_bytes"] == 0  # neither strategy checkpoints
        assert row["network_bytes"] > 0
        assert 0.0 <= row["test_auc"] <= 1.0 and row["test_logloss"] > 0
        assert row["promotion_s"] is not None and row["promotion_s"] > 0  # each run met its failure
    ecrec, none = report["strategies"]["ecrec"], report["strategies"]["none"]
    # ecrec recovers the exact state: nothing lost
    assert ecrec["state_matches_failure_free"] is True
    assert ecrec["lost_updates"] == 0 and ecrec["pls"] == 0.0
    # ... which the servers' own counters confirm (the two lines above follow from the state comparison)
    assert all(s.get("rows_lost", 0) == 0 and s.get("parity_rows_lost", 0) == 0 for s in ecrec["stats"].values()), ecrec["stats"]
    assert sum(s.get("rows_rebuilt", 0) for s in ecrec["stats"].values()) > 0
    assert ecrec["fully_redundant_s"] is not None and ecrec["fully_redundant_s"] >= ecrec["promotion_s"]
    assert ecrec["test_auc"] == report["reference"]["test_auc"]  # same state, same evaluation
    # none loses the killed shard's updates
    assert none["state_matches_failure_free"] is False
    assert none["lost_updates"] > 0 and none["pls"] > 0
    # k=2, m=1: one parity row per two data rows, plus replicas of the (small) dense parameters
    assert ecrec["memory_overhead"] == pytest.approx(1 / 2, rel=0.05)
    assert none["memory_overhead"] == 0.0
    assert plot_path.stat().st_size > 0
    # the report feeds `simulate`: ecrec's costs come out measured
    sim_path = tmp_path / "sim.json"
    assert cli.main(["simulate", "--servers", "8,64", "--from-compare", str(report_path), "--json", str(sim_path)]) == 0
    inputs = json.loads(sim_path.read_text())["inputs"]
    for key in ("parity_overhead", "reschedule_s", "recovery_throughput_ratio"):
        assert inputs[key]["source"] == "measured", key
    assert inputs["save_bytes_per_s"]["source"] == "default"  # no checkpointing strategy ran


@pytest.mark.parametrize("argv, message", [
    (["--strategies", "none,magic"], "unknown strategies"),
    (["--steps", "40", "--fail-at", "40"], "--fail-at must be below --steps"),
    (["--steps", "40", "--fail-at", "41"], "--fail-at must be below --steps"),
    (["--strategies", "ecrec", "--servers", "2", "--k", "2", "--m", "1", "--fail-server", "0"], "exceeds --servers"),
    (["--fail-server", "9"], "--fail-server"),
    (["--workers", "0"], "--workers"),
    (["--workers", "2", "--strategies", "cpr,cpr-mfu", "--equal-pls"], "--equal-pls needs --workers 1"),
])
def test_argument_errors_start_nothing(argv, message, monkeypatch, capsys):
    def must_not_run(*a, **kw):
        raise AssertionError("started work despite a bad argument")

    monkeypatch.setattr(compare, "prepare_data", must_not_run)
    monkeypatch.setattr(compare, "run_strategy", must_not_run)
    monkeypatch.setattr(compare.tempfile, "mkdtemp", must_not_run)
    assert cli.main(["compare", *argv]) == 2
    assert message in capsys.readouterr().err


def test_model_torchrec_without_the_extra_is_refused(monkeypatch, capsys):
    from ecrec.workload import torchrec_dlrm

    monkeypatch.setattr(torchrec_dlrm, "available", lambda: False)
    monkeypatch.setattr(compare, "prepare_data", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("started")))
    assert cli.main(["compare", "--model", "torchrec"]) == 2
    assert "needs the torchrec extra" in capsys.readouterr().err


def _fake_run(records, kill_t, events=()):
    from ecrec.wire import cluster_pb2

    return {"result": {"records": records, "evaluation": {}, "driver": None, "client_bytes": 0},
            "killed": {"time": kill_t}, "events": list(events), "state": None, "stats": {},
            "map": cluster_pb2.ClusterMap()}


def _records(steps, t0=0.0, dt=0.1, rewind_at=None):
    out, t = [], t0
    for n, step in enumerate(steps):
        out.append({"step": step, "start": t, "end": t + dt, "samples": 10, "rows": 5, "rows_by_server": {"1": 2},
                    "rewind_to": rewind_at[1] if rewind_at and n == rewind_at[0] else None})
        t += dt
    return out


def test_recovery_time_counts_the_replay_after_a_rollback():
    """Full recovery rewinds to step 3 at the failure (step 5): training is back only once it passes step 5 again."""
    steps = [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    records = _records(steps, rewind_at=(5, 3))
    row = compare.summarize("full", _fake_run(records, kill_t=0.5), None, {"fail_server": 1}, 5)
    # the kill is at 0.5; the replayed step 5 (the 9th record) ends at 0.9
    assert row["recovery_s"] == pytest.approx(0.4)


def test_recovery_time_without_rollback_and_lost_updates_of_none():
    steps = list(range(12))
    records = _records(steps)
    records[5]["end"] += 0.3  # the step hit by the failure stalls
    for r in records[6:]:
        r["start"] += 0.3
        r["end"] += 0.3
    row = compare.summarize("none", _fake_run(records, kill_t=0.45), None, {"fail_server": 1}, 5)
    assert row["max_stall_s"] == pytest.approx(0.4)
    assert row["recovery_s"] == pytest.approx(0.9 - 0.45)  # the stalled step 5 ends at 0.9; full speed after it
    # none loses every row update its failed server acknowledged before the failure: 4 steps x 2 rows
    assert row["lost_updates"] == 8 and row["pls"] == pytest.approx(8 / (12 * 5))


def test_throughput_while_recovering_counts_every_worker():
    """Two workers stepping side by side at an unchanged pace through the failure: the ratio is exactly 1
    (it used to compare both workers' wall-clock samples with one worker's rate: 2.00)."""
    records = []
    for rank in (0, 1):
        for r in _records(list(range(40))):
            records.append(dict(r, rank=rank))
    records.sort(key=lambda r: r["end"])
    events = [{"kind": "promoted", "index": 1, "wall_time": 2.05}]
    row = compare.summarize("none", _fake_run(records, kill_t=2.0, events=events), None, {"fail_server": 1}, 20)
    assert row["samples_per_s_failure_free"] == pytest.approx(2 * 10 / 0.1)  # both workers, 10 samples / 0.1 s
    # useful samples of both workers over the window from the kill, at the pace of before: exactly 1 (it used
    # to be 2.00 when both workers' samples were set against one worker's rate)
    assert row["throughput_during_recovery_ratio"] == pytest.approx(1.0)
    assert row["lost_training_s"] == pytest.approx(0.0, abs=1e-9)


def test_a_worker_done_before_the_kill_is_left_out_of_the_failure_figures():
    """Two workers at different paces: rank 1 finished its steps before the kill (it met nothing), rank 0 keeps
    its pace through it: the figures are rank 0's (they used to fail: 'no step ends after the failure')."""
    records = [dict(r, rank=0) for r in _records(list(range(40)))]
    records += [dict(r, rank=1) for r in _records(list(range(10)), dt=0.05)]  # done at 0.5 s
    records.sort(key=lambda r: r["end"])
    events = [{"kind": "promoted", "index": 1, "wall_time": 2.05}]
    row = compare.summarize("none", _fake_run(records, kill_t=2.0, events=events), None, {"fail_server": 1}, 20)
    assert row["max_stall_s"] == pytest.approx(0.1) and row["promotion_s"] == pytest.approx(0.05)
    assert row["lost_training_s"] is not None and row["throughput_during_recovery_ratio"] is not None


# --- the workloads and launchers a user can pick, end to end at a small size ---------------------------------

@pytest.fixture
def tiny_preset(monkeypatch):
    """The quick preset at a CI-friendly size (the same code path; only the sizes differ)."""
    monkeypatch.setitem(compare.PRESETS, "quick", dict(
        compare.PRESETS["quick"], batch_size=64, tables=3, rows_per_table=400, samples=4000, embedding_dim=8,
        checkpoint_interval_steps=20, cpr_interval_s=1.0, partial_interval_s=0.3))


@pytest.mark.benchmark
@pytest.mark.cluster
@pytest.mark.timeout(1800)
def test_two_workers_under_torchrun_meet_the_failure(tmp_path, tiny_preset):
    """``--workers 2``: torchrun starts two ranks that create the tables and register the dense layers at
    once; every strategy's run (not only the first) meets the kill, and ``none`` keeps its pace through it."""
    report_path = tmp_path / "r.json"
    rc = cli.main(["compare", "--strategies", "none,ecrec", "--workers", "2", "--steps", "40", "--fail-at", "20",
                   "--json", str(report_path)])  # (no side-by-side rounds with two workers: --rounds is refused)
    assert rc == 0
    report = json.loads(report_path.read_text())
    assert report["config"]["workers"] == 2
    assert report["config"]["throughput_measurement"] == "sequential runs, reference before and after"
    for name in ("none", "ecrec"):
        row = report["strategies"][name]
        assert row["promotion_s"] is not None and row["promotion_s"] > 0, (name, row["stats"])
        assert row["max_stall_s"] is not None and row["throughput_during_recovery_ratio"] is not None, name
        assert row["rows_acknowledged"] > 0 and row["samples_per_s_failure_free"] > 0
        # two ranks' states interleave differently run to run: there is no failure-free state to compare with
        assert row["state_matches_failure_free"] is None
    ecrec = report["strategies"]["ecrec"]
    assert ecrec["fully_redundant_s"] is not None
    stats = ecrec["stats"]
    assert sum(s.get("rows_rebuilt", 0) for s in stats.values()) > 0, stats  # a replacement rebuilt rows
    assert all(s.get("rows_lost", 0) == 0 and s.get("parity_rows_lost", 0) == 0 for s in stats.values()), stats
    assert report["strategies"]["none"]["lost_updates"] > 0


@pytest.mark.benchmark
@pytest.mark.cluster
@pytest.mark.timeout(1800)
def test_side_by_side_overhead_rounds(tmp_path, tiny_preset):
    """``--fail-at >= 100`` with one worker: every strategy and a failure-free reference train in interleaved
    slices; the overhead is the median over the slices of reference / strategy throughput, minus 1."""
    report_path = tmp_path / "r.json"
    rc = cli.main(["compare", "--strategies", "none,ecrec", "--steps", "130", "--fail-at", "100", "--rounds", "2",
                   "--json", str(report_path)])
    assert rc == 0
    report = json.loads(report_path.read_text())
    plan = report["config"]["throughput_measurement"]
    # warm-up min(WARM_STEPS, 100 // 4) = 25 steps; the rounds end 30 steps before the failure (its phase is
    # planned from there): int(linspace(25, 70, 3))
    assert compare.WARM_STEPS >= 25
    assert plan["rounds"] == 2 and plan["bounds"] == [25, 47, 70]
    ref = report["reference"]["samples_per_s_rounds"]
    assert len(ref) == 2 and all(r > 0 for r in ref)
    for name in ("none", "ecrec"):
        row = report["strategies"][name]
        mine = row["samples_per_s_rounds"]
        assert len(mine) == 2
        assert row["overhead_vs_none"] == pytest.approx(float(np.median(np.array(ref) / np.array(mine))) - 1.0)
        assert row["samples_per_s_failure_free"] == pytest.approx(float(np.median(mine)))
        assert set(row["cpu_ms_per_step"]) == {"worker", "servers", "coordinator", "total"}
        assert row["promotion_s"] is not None
    assert report["strategies"]["ecrec"]["state_matches_failure_free"] is True


def _atomic_movielens(directory, ratings: int = 3000, users: int = 60, items: int = 80, seed: int = 0):
    """A fake ml-100k in RecBole's atomic format (real MovieLens needs the network)."""
    rng = np.random.default_rng(seed)
    d = directory / "ml-100k"
    d.mkdir(parents=True)
    inter = ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
    for _ in range(ratings):
        inter.append(f"{rng.integers(1, users + 1)}\t{rng.integers(1, items + 1)}\t{rng.integers(1, 6)}\t"
                     f"{874965758 + int(rng.integers(0, 10_000_000))}")
    (d / "ml-100k.inter").write_text("\n".join(inter) + "\n")
    genders, jobs = ("M", "F"), ("technician", "other", "writer", "artist")
    (d / "ml-100k.user").write_text("user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n" + "".join(
        f"{u}\t{18 + u % 50}\t{genders[u % 2]}\t{jobs[u % 4]}\t{10000 + 37 * u}\n" for u in range(1, users + 1)))
    genres = ("Action", "Comedy", "Drama", "Thriller")
    (d / "ml-100k.item").write_text("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n" + "".join(
        f"{i}\tMovie {i}\t{1950 + i % 45}\t{genres[i % 4]} {genres[(i + 1) % 4]}\n" for i in range(1, items + 1)))


@pytest.mark.benchmark
@pytest.mark.cluster
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("dataset", ["criteo", "movielens"])
def test_real_format_datasets(tmp_path, tiny_preset, monkeypatch, dataset):
    """``--dataset criteo:PATH`` (a Criteo TSV, ids hashed into rows_per_table rows) and ``--dataset movielens``
    (from ``$ECREC_DATA/ml-100k``) train through a failure like the synthetic set, ecrec bit-exact."""
    from ecrec.workload.data import write_synthetic_criteo

    if dataset == "criteo":
        tsv = tmp_path / "day_0.tsv"
        write_synthetic_criteo(tsv, 3000, num_tables=26, rows_per_table=300, seed=2)
        arg, name, samples, tables = f"criteo:{tsv}", "criteo", 3000, 26
    else:
        _atomic_movielens(tmp_path)
        monkeypatch.setenv("ECREC_DATA", str(tmp_path))
        arg, name, samples, tables = "movielens", "movielens-100k", 3000, 9
    report_path = tmp_path / "r.json"
    rc = cli.main(["compare", "--strategies", "ecrec", "--dataset", arg, "--steps", "24", "--fail-at", "12",
                   "--json", str(report_path)])
    assert rc == 0
    report = json.loads(report_path.read_text())
    desc = report["config"]["dataset"]
    assert desc["name"] == name and desc["samples"] == samples and desc["tables"] == tables
    row = report["strategies"]["ecrec"]
    assert row["state_matches_failure_free"] is True and row["lost_updates"] == 0
    assert row["promotion_s"] is not None and 0.0 <= row["test_auc"] <= 1.0


def test_unknown_or_missing_dataset_is_refused(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit, match=r"no such Criteo file '.*missing\.tsv'"):
        cli.main(["compare", "--strategies", "none", "--dataset", f"criteo:{tmp_path / 'missing.tsv'}"])
    # (a missing MovieLens is fetched on demand: issue 13)
    with pytest.raises(SystemExit, match=r"unknown --dataset 'imagenet' \(synthetic \| criteo:PATH \| movielens\)"):
        cli.main(["compare", "--strategies", "none", "--dataset", "imagenet"])



def test_a_criteo_file_compare_cannot_train_on_is_refused_naming_why(tmp_path, monkeypatch):
    """A directory, a broken ``.gz``, a file of malformed lines or too few samples ended in a traceback (an
    IsADirectoryError, a gzip error, 'ValueError: 0 samples are too few to split off 10%') after the banner."""
    from ecrec.workload.data import write_synthetic_criteo

    monkeypatch.setattr(compare, "run_strategy", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("started")))
    (tmp_path / "bad.tsv").write_text("1\t2\t3\n")
    (tmp_path / "bad.gz").write_bytes(b"not gzip")
    write_synthetic_criteo(tmp_path / "few.tsv", 283, num_tables=26, rows_per_table=30, seed=1)
    for name, said in [(".", "is a directory; name a Criteo TSV file"),
                       ("bad.gz", "cannot be read: Not a gzipped file"),
                       ("bad.tsv", "holds 0 sample(s), fewer than the 284 a batch of 256 and its test split need"),
                       ("few.tsv", "holds 283 sample(s), fewer than the 284")]:
        path = tmp_path / name
        with pytest.raises(SystemExit) as raised:
            cli.main(["compare", "--strategies", "none", "--fail-at", "-1", "--batch-size", "256",
                      "--dataset", f"criteo:{path}"])
        assert said in str(raised.value), (name, str(raised.value))
        if name == "bad.tsv":  # what was wrong with the lines it skipped
            assert "skipped 1 malformed line(s) of 1: 1 (wrong column count: 3 columns, expected 40)" in str(raised.value)
    with pytest.raises(SystemExit, match="holds 283 sample.s., fewer than the 569 a batch of 256 for each of 2 workers"):
        cli.main(["compare", "--strategies", "none", "--fail-at", "-1", "--batch-size", "256", "--workers", "2",
                  "--dataset", f"criteo:{tmp_path / 'few.tsv'}"])  # each worker trains on a shard: a batch each

# --- the fair comparison (issue 13) ---------------------------------------------------------------------------
@pytest.mark.benchmark
@pytest.mark.cluster
def test_equal_pls_mode_tunes_mfu_to_cprs_pls(tmp_path):
    """--equal-pls: cpr-mfu saves its full checkpoint less often (its partial saves keep hot rows fresh), at the
    PLS of cpr's interval; the servers run the tuned intervals, and the memory column counts MFU's counters."""
    report_path = tmp_path / "r.json"
    rc = cli.main(["compare", "--strategies", "cpr,cpr-mfu", "--equal-pls", "--steps", "80", "--fail-at", "50",
                   "--failures", "1", "--json", str(report_path)])
    assert rc == 0
    report = json.loads(report_path.read_text())
    assert report["config"]["equal_pls"] is True
    cpr, mfu = report["intervals"]["cpr"], report["intervals"]["cpr-mfu"]
    # cpr: 2 x PLS 0.01 x 4 servers x MTBF 10 s (the quick preset's)
    assert cpr["how"] == "target PLS" and cpr["interval_s"] == pytest.approx(0.8)
    assert mfu["how"].startswith("equal PLS")
    assert 0 < mfu["lost_ratio"] < 1  # replayed on this run's Zipf updates: MFU leaves fewer updates unsaved
    assert mfu["interval_s"] == pytest.approx(0.8 / mfu["lost_ratio"])
    assert mfu["expected_pls"] == pytest.approx(cpr["expected_pls"])
    assert mfu["servers_interval_s"] == [pytest.approx(mfu["interval_s"])]  # every server runs the tuned interval
    assert mfu["servers_partial_interval_s"] == [pytest.approx(mfu["interval_s"] / 4)]
    rows = report["strategies"]
    for name in ("cpr", "cpr-mfu"):
        assert rows[name]["lost_updates"] is not None and rows[name]["lost_updates"] >= 0
        assert len(rows[name]["failures"]) <= 1 and rows[name]["failures_planned"] == 1
    # MFU keeps a counter per row (int64) beside cpr's per-row bookkeeping: more memory for fault tolerance
    assert rows["cpr-mfu"]["memory_overhead"] > rows["cpr"]["memory_overhead"] > 0


@pytest.mark.benchmark
@pytest.mark.cluster
def test_cpr_with_an_mtbf_runs_at_the_pls_interval(tmp_path):
    """`--strategies cpr --mtbf-hours 1` used to crash the coordinator (mtbf without target PLS); now the
    interval 2 x PLS x servers x MTBF is chosen and passed explicitly."""
    report_path = tmp_path / "r.json"
    rc = cli.main(["compare", "--strategies", "cpr", "--mtbf-hours", "1", "--steps", "30", "--fail-at", "10",
                   "--failures", "1", "--json", str(report_path)])
    assert rc == 0
    report = json.loads(report_path.read_text())
    assert report["intervals"]["cpr"]["interval_s"] == pytest.approx(2 * 0.01 * 4 * 3600)
    assert report["config"]["mtbf_s"] == 3600


@pytest.mark.cluster
def test_a_child_that_fails_to_start_is_quoted(tmp_path):
    """The coordinator refuses options it cannot use and exits; the error names its own message."""
    from ecrec.ops.local import LocalCluster, LocalClusterSpec

    cluster = LocalCluster(LocalClusterSpec(servers=2, strategy="cpr", options={"dir": str(tmp_path / "c")},
                                            host="127.0.0.1"))
    try:
        with pytest.raises(RuntimeError) as exc:
            cluster.start()
    finally:
        cluster.close()
    text = str(exc.value)
    assert "coordinator did not start (exit code 2)" in text
    assert "needs an interval" in text  # the child's own words, from its stderr


@pytest.mark.parametrize("argv, message", [
    (["--failures", "0"], "--failures must be >= 1"),
    (["--mtbf-hours", "0"], "--mtbf-hours must be finite and > 0"),
    (["--target-pls", "1.5"], "--target-pls must be in (0, 1)"),
    (["--cpr-interval-s", "-2"], "--cpr-interval-s must be finite and > 0"),
    (["--checkpoint-interval-steps", "0"], "--checkpoint-interval-steps must be >= 1"),
    (["--equal-pls", "--strategies", "none,cpr"], "--equal-pls tunes cpr-mfu and cpr-ssu"),
])
def test_fairness_argument_errors_start_nothing(argv, message, monkeypatch, capsys):
    def must_not_run(*a, **kw):
        raise AssertionError("started work despite a bad argument")

    monkeypatch.setattr(compare, "prepare_data", must_not_run)
    monkeypatch.setattr(compare, "run_strategy", must_not_run)
    monkeypatch.setattr(compare.tempfile, "mkdtemp", must_not_run)
    assert cli.main(["compare", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_range_of_negative_figures_reads_as_two_numbers():
    """The reports' ranges: ``[low, high]``, not ``low-high`` (which printed a run that gained time as
    ``-0.01--0.01``)."""
    from ecrec.bench.table import span

    assert span("{:.2f}")((-0.37, -0.01)) == "[-0.37, -0.01]"
    assert span("{:.3f}")((0.4, 0.5)) == "[0.400, 0.500]"


def test_failures_are_summarized_as_mean_and_range():
    """Two failures of a rollback strategy: per-failure lost training time, their mean and range."""
    # rate 10 samples / 0.1 s; kill 1 at 0.5 (step 5 stalls 0.3 s, rolled back to step 3; 3, 4 replayed);
    # kill 2 at 2.0 (step 19 stalls 0.2 s, rolled back to 17; 17, 18 replayed)
    steps = [0, 1, 2, 3, 4, 5, 3, 4, *range(5, 19), 19, 17, 18, *range(19, 26)]
    durations = [0.1] * 5 + [0.3] + [0.1] * 16 + [0.2] + [0.1] * 9
    records, t = [], 0.0
    for i, (s, d) in enumerate(zip(steps, durations)):
        rewind = 3 if i == 5 else (17 if i == 22 else None)
        records.append({"step": s, "start": t, "end": t + d, "samples": 10, "rows": 5, "rows_by_server": {},
                        "rewind_to": rewind})
        t += d
    kill2 = records[22]["start"]
    run = _fake_run(records, None)
    run["killed"] = {"failures": [{"time": 0.5, "step": 5, "phase": 0.25}, {"time": kill2, "step": 19, "phase": 0.75}]}
    row = compare.summarize("full", run, None, {"fail_server": 1}, 5)
    first, second = row["failures"]
    assert first["lost_training_s"] == pytest.approx(0.3 + 0.2)  # the stalled step + 2 replayed steps
    assert second["lost_training_s"] == pytest.approx(0.2 + 0.2)
    assert row["lost_training_s"] == pytest.approx(0.45)
    assert row["lost_training_s_range"] == pytest.approx([0.4, 0.5])
    assert first["phase"] == 0.25 and second["phase"] == 0.75
    assert row["throughput_during_recovery_ratio"] == pytest.approx(
        (first["useful_throughput_ratio"] + second["useful_throughput_ratio"]) / 2)


# --- the report as a function of the records it saves ------------------------------------------------------
def _fake_interleaved(strategies, fail_at, rounds=6, seed=0):
    """What ``run_interleaved`` returns, without clusters: each strategy loses a pause at its kill, and slices
    of every run at rates that vary round to round (the reference in two parts)."""
    rng = np.random.default_rng(seed)
    results = {}
    for name in ["reference", *strategies]:
        durations = [0.01] * 200
        kill_t = None
        if name != "reference":
            durations[150] = 0.3
            kill_t = 1.5 + 1e-6
        run = _fake_run(_records(list(range(200)), dt=0.01), kill_t)
        t = 0.0
        for r, d in zip(run["result"]["records"], durations):
            r.update(start=t, end=t + d)
            t += d
        run["planned_failures"] = 0 if name == "reference" else 1
        run["load_average"] = {"before": [0.5, 0.5, 0.5], "after": [0.7, 0.6, 0.5]}
        results[name] = run
    slices = []
    speed = {"reference": 1.0, "none": 1.0, "ecrec": 1 / 1.1}
    for r in range(rounds):
        machine = 1000 * (1 + 0.1 * rng.standard_normal())
        for name in ["reference", "reference", *strategies]:
            part = sum(1 for s in slices if s["run"] == name and s["round"] == r) if name == "reference" else None
            rate = machine * speed[name] * (1 + 0.01 * rng.standard_normal())
            slices.append({"round": r, "position": 0, "run": name, "part": part, "first_step": 0, "end_step": 10,
                           "samples": 1000, "wall_s": 1000 / rate, "load_average": 0.5,
                           "cpu_s": {"worker": 0.5 / speed[name], "servers": 0.5, "coordinator": 0.01}})
    plan = {"rounds": rounds, "bounds": [], "orders": [], "slices": slices, "failure_order": list(strategies)}
    return results, plan


@pytest.fixture
def fake_compare(tmp_path, monkeypatch, capsys):
    """A compare run of none and ecrec whose runs are :func:`_fake_interleaved`'s records (no cluster): its JSON's
    path and what it printed."""
    monkeypatch.setattr(compare, "prepare_data", lambda args, cfg, work: (tmp_path / "d.npz", {"name": "fake"}))
    monkeypatch.setattr(compare, "run_interleaved",
                        lambda strategies, args, cfg, data_path, work, fail_at, rounds: _fake_interleaved(strategies, fail_at))
    monkeypatch.setattr(compare.os, "getloadavg", lambda: (0.25, 0.25, 0.25))  # a machine to itself
    path = tmp_path / "r.json"
    assert cli.main(["compare", "--strategies", "none,ecrec", "--steps", "200", "--fail-at", "150",
                     "--model", "ecrec", "--json", str(path)]) == 0
    return path, capsys.readouterr().out


def test_the_report_is_a_function_of_the_records_it_saves(fake_compare):
    """The JSON holds every step and slice; the table recomputed from them alone is the table."""
    from ecrec.bench import accounting

    path, out = fake_compare
    assert "none (A/A)" in out and "cpu 95% CI" in out
    report = json.loads(path.read_text())
    runs = report["runs"]
    assert set(runs) == {"reference", "none", "ecrec"}
    assert set(runs["ecrec"]["steps"]) == set(accounting.STEP_FIELDS) and len(runs["ecrec"]["steps"]["step"]) == 200
    assert runs["ecrec"]["load_average"]["before"] == [0.5, 0.5, 0.5]
    again = accounting.table(runs, report["config"]["throughput_measurement"]["slices"], ["none", "ecrec"], 150)
    for row in again["rows"]:
        saved = report["strategies"][row["strategy"]]
        for key in ("samples_per_s_failure_free", "overhead_vs_none", "cpu_overhead_vs_none", "lost_training_s",
                    "throughput_during_recovery_ratio", "paused_s", "deficit_s", "lost_updates"):
            expected = saved[key] if saved[key] is None else pytest.approx(saved[key], rel=1e-9)
            assert row[key] == expected, (row["strategy"], key)
    ecrec = report["strategies"]["ecrec"]
    assert ecrec["overhead_vs_none"] == pytest.approx(0.1, abs=0.03)
    assert ecrec["overhead_spread"]["ci95_low"] <= ecrec["overhead_vs_none"] <= ecrec["overhead_spread"]["ci95_high"]
    assert ecrec["cpu_overhead_spread"]["ci95_low"] is not None
    assert ecrec["lost_training_s"] == pytest.approx(0.29)  # the 0.3 s step less one normal step
    assert report["aa_overhead"]["wall"]["within_noise"] is True
    assert report["load_warnings"] == [] and report["config"]["load_average_before"] == [0.25, 0.25, 0.25]


def test_report_recomputes_a_saved_json_from_its_records(fake_compare, tmp_path, capsys):
    """``ecrec-bench report`` reprints a compare JSON's table from its records alone, equal to the saved
    one, with the cost per day at another MTBF on request; a file that is not a compare JSON is refused."""
    path, again = fake_compare[0], tmp_path / "again.json"
    assert cli.main(["report", str(path), "--cost-mtbf-hours", "8", "--json", str(again)]) == 0
    out = capsys.readouterr().out
    assert "largest relative difference from the saved table 0.00e+00" in out
    assert "expected cost per day of training at an MTBF of 8 h" in out
    saved, recomputed = json.loads(path.read_text()), json.loads(again.read_text())
    assert recomputed["strategies"]["ecrec"]["lost_training_s"] == saved["strategies"]["ecrec"]["lost_training_s"]
    assert set(recomputed["cost_per_day"]) == {"8", f"{saved['config']['mtbf_s'] / 3600:g}"}
    (tmp_path / "other.json").write_text(json.dumps({"strategies": {}}))
    assert cli.main(["report", str(tmp_path / "other.json")]) == 2
    assert "not written by `ecrec-bench compare --json`" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path / "missing.json")]) == 2


@pytest.mark.benchmark
@pytest.mark.cluster
def test_ecrecs_periodic_snapshots_are_timed_inside_its_steps(tmp_path):
    """``--snapshot-every 10``: the erasure-coded run's worker snapshots after steps 10, 20 and 30, each inside
    the step it ends (so ECRec's overhead counts it), the newest kept; ``none`` takes none."""
    report_path = tmp_path / "r.json"
    assert cli.main(["compare", "--strategies", "none,ecrec", "--steps", "30", "--fail-at", "-1",
                     "--snapshot-every", "10", "--work-dir", str(tmp_path / "work"), "--keep",
                     "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["config"]["snapshot_every"] == 10
    runs = report["runs"]
    snapshots = runs["ecrec"]["snapshots"]
    assert [s["step"] for s in snapshots] == [9, 19, 29] and all(s["seconds"] > 0 for s in snapshots)
    steps = runs["ecrec"]["steps"]
    for s in snapshots:  # the step that took it lasted at least as long as the snapshot
        i = steps["step"].index(s["step"])
        assert steps["end"][i] - steps["start"][i] >= s["seconds"]
    assert runs["none"]["snapshots"] == []
    kept = sorted((tmp_path / "work").glob("snapshots-ecrec*/step-*"))
    assert [p.name for p in kept] == ["step-000000030"] and (kept[0] / "manifest.json").exists()


def test_snapshot_every_needs_one_worker(capsys):
    assert cli.main(["compare", "--workers", "2", "--strategies", "none,ecrec", "--snapshot-every", "5"]) == 2
    assert "--snapshot-every needs --workers 1" in capsys.readouterr().err
