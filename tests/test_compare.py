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
