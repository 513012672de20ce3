"""``ecrec-bench compare``: the quick preset end to end for two strategies, and its argument errors."""

from __future__ import annotations

import importlib.util
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
