"""``ecrec-bench compare``: the quick preset end to end for two strategies, and its argument errors."""

from __future__ import annotations

import json

import pytest

from ecrec.bench import cli, compare

REQUIRED = (
    "samples_per_s_failure_free", "overhead_vs_none", "recovery_s", "fully_redundant_s", "max_stall_s",
    "throughput_during_recovery_ratio", "lost_updates", "pls", "test_auc", "test_logloss",
    "state_matches_failure_free", "memory_overhead", "checkpoint_bytes", "network_bytes",
)


@pytest.mark.cluster
def test_quick_none_and_ecrec(tmp_path):
    report_path, plot_path = tmp_path / "r.json", tmp_path / "p.png"
    rc = cli.main(["compare", "--strategies", "none,ecrec", "--steps", "40", "--fail-at", "20",
                   "--json", str(report_path), "--plot", str(plot_path)])
    assert rc == 0
    report = json.loads(report_path.read_text())
    assert report["config"]["steps"] == 40 and report["config"]["fail_at"] == 20
    assert report["config"]["strategies"] == ["none", "ecrec"]
    assert set(report["strategies"]) == {"none", "ecrec"}
    for name, row in report["strategies"].items():
        missing = [key for key in REQUIRED if key not in row]
        assert not missing, f"{name}: missing {missing}"
        assert row["samples_per_s_failure_free"] > 0
        assert row["checkpoint_bytes"] == 0  # neither strategy checkpoints
        assert row["network_bytes"] > 0
        assert 0.0 <= row["test_auc"] <= 1.0 and row["test_logloss"] > 0
    ecrec, none = report["strategies"]["ecrec"], report["strategies"]["none"]
    # ecrec recovers the exact state: nothing lost
    assert ecrec["state_matches_failure_free"] is True
    assert ecrec["lost_updates"] == 0 and ecrec["pls"] == 0.0
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
    (["--workers", "2", "--strategies", "none,cpr"], "need one checkpoint driver"),
])
def test_argument_errors_start_nothing(argv, message, monkeypatch, capsys):
    def must_not_run(*a, **kw):
        raise AssertionError("started work despite a bad argument")

    monkeypatch.setattr(compare, "prepare_data", must_not_run)
    monkeypatch.setattr(compare, "run_strategy", must_not_run)
    monkeypatch.setattr(compare.tempfile, "mkdtemp", must_not_run)
    assert cli.main(["compare", *argv]) == 2
    assert message in capsys.readouterr().err


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


# --- the fair comparison (issue 13) ---------------------------------------------------------------------------
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


def test_a_child_that_fails_to_start_is_quoted(tmp_path):
    """The coordinator refuses options it cannot use and exits; the error names its own message."""
    from ecrec.local import LocalCluster, LocalClusterSpec

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
