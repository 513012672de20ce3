"""``ecrec-bench recovery``: a small run of every strategy end to end, its argument errors, and the
training-time-lost arithmetic."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ecrec.bench import cli, recovery
from ecrec.bench.recovery_training import describe_cpu, lost_training, rebuild_cpu


def _records(steps, t0=0.0, dt=0.1, gaps=None):
    out, t = [], t0
    for n, step in enumerate(steps):
        t += (gaps or {}).get(n, 0.0)
        out.append({"step": step, "start": t, "end": t + dt, "samples": 10})
        t += dt
    return out


def test_lost_training_of_an_undisturbed_run_is_zero():
    records = _records(range(40))
    figures = lost_training(records, kill_time=2.0)
    assert figures["rate_before"] == pytest.approx(100.0)
    assert figures["lost_training_s"] == pytest.approx(0.0, abs=1e-9)
    assert figures["throughput_ratio"] == pytest.approx(1.0)
    assert figures["longest_step_s"] == pytest.approx(0.1)


def test_lost_training_counts_a_pause_and_a_replay():
    # 20 steps, the kill at t=2.05, a pause until 3.5, then a rollback to step 10 (steps 10..19 redone)
    records = _records(list(range(20)) + list(range(10, 30)), gaps={20: 1.5})
    figures = lost_training(records, kill_time=2.05)
    assert figures["replayed_s"] == pytest.approx(1.0)  # ten redone steps of 0.1 s
    assert figures["paused_s"] == pytest.approx(1.45)
    assert figures["lost_training_s"] == pytest.approx(2.45)
    assert figures["deficit_s"] == pytest.approx(0.0, abs=1e-9)


def test_lost_training_counts_slow_steps_as_deficit():
    records = _records(range(20)) + _records(range(20, 40), t0=2.0, dt=0.2)  # half speed after the kill
    figures = lost_training(records, kill_time=2.001, recovering_from=2.001, recovering_until=6.1)
    assert figures["lost_training_s"] == pytest.approx(2.0, abs=0.002)
    assert figures["throughput_ratio"] == pytest.approx(0.5, abs=0.01)
    assert figures["deficit_s"] == pytest.approx(2.0 - figures["paused_s"])
    with pytest.raises(ValueError, match="before and after"):
        lost_training(records, kill_time=100.0)


@pytest.mark.parametrize("argv, message", [
    (["--strategies", "ecrec,magic"], "unknown strategies"),
    (["--strategies", "ecrec,ecrec"], "twice"),
    (["--rows", "0"], "--rows must be >= 1"),
    (["--servers", "2", "--k", "2", "--m", "1"], "exceeds --servers"),
    (["--fail-server", "4"], "--fail-server"),
    (["--option", "rebuild_batch_rows"], "KEY=VALUE"),
    (["--option", "rebuild_slowdown=-1"], "rebuild_slowdown must be >= 0"),
    (["--option", "no_such_option=1"], "no_such_option"),
    (["--target-pls", "1.5"], "--target-pls"),
    (["--server-option", "no_gc_freeze"], "--server-option 'no_gc_freeze': expected KEY=VALUE"),
    (["--server-option", "gc=off"], "--server-option gc: no such server setting"),
])
def test_argument_errors_start_nothing(argv, message, monkeypatch, capsys):
    def must_not_run(*a, **kw):
        raise AssertionError("started work despite a bad argument")

    monkeypatch.setattr(recovery, "run_strategy", must_not_run)
    assert cli.main(["recovery", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.benchmark
@pytest.mark.cluster
def test_small_recovery_of_every_strategy(tmp_path, capsys):
    report_path, plot_path = tmp_path / "r.json", tmp_path / "r.png"
    rc = cli.main(["recovery", "--rows", "30000", "--dim", "16", "--tables", "2", "--strategies", "ecrec,full,cpr",
                   "--json", str(report_path), "--plot", str(plot_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "go-on s" in out and "redundant s" in out
    report = json.loads(report_path.read_text())
    rows = report["strategies"]
    assert set(rows) == {"ecrec", "full", "cpr"}
    row_bytes = 16 * 2 * 4  # adagrad: weights and accumulator
    for name, row in rows.items():
        assert row["exact"] is True, name  # every row back, bit for bit
        assert 0 < row["go_on_s"] <= row["redundant_s"] + 1e-6, name
        assert row["restored_bytes"] > 0 and row["restored_mb_per_s"] > 0, name
        assert row["model_bytes"] == 2 * 30000 * row_bytes
        assert row["memory_gb_per_model_gb"] > 0
        # every server's full garbage collections since it started serving (the replacement's since its own start),
        # with its start-up's objects frozen out of them (ecrec.server.collector)
        assert sorted(row["server_gc"]) == ["0", "1", "2", "3"], name
        for gc_status in row["server_gc"].values():
            assert gc_status["gc_frozen_objects"] > 20_000 and gc_status["gc_full_collections"] >= 0, name
    ecrec = rows["ecrec"]
    # the failed server held a quarter of the rows and (k=2, m=1) half as many parity rows
    assert ecrec["rows_rebuilt"] == pytest.approx(2 * 30000 / 4 * 1.5, rel=0.01)
    assert ecrec["parity_mismatched"] == 0
    # the fast path's CPU by part, from the servers' thread clocks: every part measured, none more than the
    # servers' processes spent from the kill to redundancy, the survivors' frames the bytes the replacement read
    cpu = ecrec["rebuild_cpu"]
    for part in ("survivors_gather", "survivors_send", "replacement_receive", "replacement_decode",
                 "replacement_install"):
        assert cpu[part + "_cpu_s"] > 0, part
    assert cpu["survivors_seal_cpu_s"] >= 0 and cpu["replacement_checks_cpu_s"] >= 0
    # /proc rounds each process's utime and stime down to 10 ms ticks separately: up to 20 ms per process short
    assert cpu["total_cpu_s"] <= ecrec["recovery_cpu_s"] + 0.02 * 5
    assert cpu["transport"] == "socket" and "unread_servers" not in cpu and "unbalanced" not in cpu
    assert cpu["rebuilt_mb"] == pytest.approx(ecrec["bulk_rows"] * row_bytes / 1e6)
    assert cpu["streamed_mb"] >= 2 * cpu["rebuilt_mb"]  # k = 2 members read per row rebuilt
    assert cpu["ms_per_mb"]["total"] == pytest.approx(1e3 * cpu["total_cpu_s"] / cpu["rebuilt_mb"])
    assert rows["full"]["restored_bytes"] >= 2 * 30000 * row_bytes  # every server reloads
    assert rows["cpr"]["restored_bytes"] < rows["full"]["restored_bytes"]  # only the failed shard
    for name in ("full", "cpr"):
        assert rows[name]["reload_s"] > 0 and rows[name]["checkpoint_bytes"] > 0
    assert plot_path.stat().st_size > 0


@pytest.mark.benchmark
@pytest.mark.cluster
def test_during_training_reports_the_training_lost(tmp_path):
    report_path = tmp_path / "r.json"
    rc = cli.main(["recovery", "--rows", "20000", "--dim", "8", "--strategies", "ecrec", "--during-training",
                   "--before-s", "1.5", "--after-s", "0.5", "--batch-size", "64", "--json", str(report_path)])
    assert rc == 0
    row = json.loads(report_path.read_text())["strategies"]["ecrec"]
    for key in ("lost_training_s", "paused_s", "replayed_s", "deficit_s", "throughput_ratio", "longest_step_s",
                "samples_per_s_before", "redundant_s", "timeline", "go_on_s"):
        assert row.get(key) is not None, key
    assert row["replayed_s"] == 0.0  # nothing rolls back under ecrec
    assert row["samples_per_s_before"] > 0 and row["longest_step_s"] > 0
    # what the replacement's rebuild took, by part, from its own counters
    parts = row["failures"][0]["rebuild_parts"]
    assert parts["rebuild_s"] > 0 and parts["rows_rebuilt"] > 0 and parts["parity_rows_rebuilt"] > 0
    assert parts["bulk_s"] > 0 and parts["bulk_rows_rebuilt"] > 0
    assert parts["on_demand_calls"] >= 1 and parts["on_demand_s"] > 0  # the step after the kill touched its rows
    assert parts["on_demand_rounds"] >= parts["on_demand_calls"]  # at least one round of reads a request
    assert "rebuild_duty" not in parts  # not paced by default
    cpu = row["failures"][0]["rebuild_cpu"]
    assert cpu["replacement_receive_cpu_s"] > 0 and cpu["survivors_gather_cpu_s"] > 0
    assert cpu["survivors_send_cpu_s"] > 0 and cpu["replacement_decode_cpu_s"] > 0
    # the survivors' counters moved from the kill on: they streamed every member the fast path decoded (k = 2 a row,
    # rows rebuilt on demand meanwhile streamed too but not installed by it)
    assert cpu["streamed_mb"] >= 2 * cpu["rebuilt_mb"] > 0
    assert "unread_servers" not in cpu and "unbalanced" not in cpu and "before_redundancy" not in cpu


def test_the_fast_paths_cpu_by_part_is_what_the_counters_moved():
    before = {0: {"stream_cpu_s": 1.0, "stream_read_cpu_s": 0.5, "stream_seal_cpu_s": 0.1, "stream_bytes": 1e6},
              2: {"stream_cpu_s": 0.0, "stream_read_cpu_s": 0.0, "stream_seal_cpu_s": 0.0, "stream_bytes": 0.0}}
    after = {0: {"stream_cpu_s": 2.0, "stream_read_cpu_s": 1.0, "stream_seal_cpu_s": 0.2, "stream_bytes": 5e6},
             2: {"stream_cpu_s": 0.5, "stream_read_cpu_s": 0.2, "stream_seal_cpu_s": 0.0, "stream_bytes": 4e6},
             3: {"stream_cpu_s": 9.0, "stream_read_cpu_s": 9.0, "stream_seal_cpu_s": 0.0, "stream_bytes": 9e6}}
    replacement = {"bulk_receive_cpu_s": 0.4, "bulk_decode_cpu_s": 0.1, "bulk_install_cpu_s": 0.2,
                   "bulk_round_cpu_s": 0.5, "bulk_rows_rebuilt": 10_000}
    cpu = rebuild_cpu(before, after, replacement, row_bytes=400)  # 4 MB rebuilt
    assert cpu["survivors_gather_cpu_s"] == pytest.approx(0.7)  # server 3: no counters at the kill, not counted
    assert cpu["survivors_seal_cpu_s"] == pytest.approx(0.1)
    assert cpu["survivors_send_cpu_s"] == pytest.approx(1.5 - 0.7 - 0.1)
    assert cpu["replacement_checks_cpu_s"] == pytest.approx(0.2)
    assert cpu["streamed_mb"] == pytest.approx(8.0)
    assert cpu["total_cpu_s"] == pytest.approx(0.7 + 0.1 + 0.7 + 0.4 + 0.1 + 0.2 + 0.2)
    assert cpu["ms_per_mb"]["survivors_gather"] == pytest.approx(700 / 4)
    assert "gather 175.00" in describe_cpu(cpu) and "receive 100.00" in describe_cpu(cpu)
    assert cpu["ms_per_mb_streamed"] == pytest.approx(1e3 * cpu["total_cpu_s"] / 8.0)
    assert cpu["transport"] is None and "unbalanced" not in cpu
    # a survivor that did not answer is named; counters that do not balance are flagged; the transport is said
    named = rebuild_cpu(before, after, {**replacement, "bulk_bytes_read": 8e6}, row_bytes=400, survivors=[0, 1, 2])
    assert named["unread_servers"] == [1] and named["transport"] == "grpc"
    assert "servers [1] did not answer" in describe_cpu(named) and "gRPC's own threads" in describe_cpu(named)
    short = {**after, 0: {**after[0], "stream_cpu_s": 1.2}}  # a stream abandoned: its send not counted yet
    unbalanced = rebuild_cpu(before, short, {**replacement, "bulk_bytes_read": 8e6, "bulk_bytes_over_socket": 8e6},
                             row_bytes=400)
    assert unbalanced["unbalanced"] and unbalanced["survivors_send_cpu_s"] == 0.0
    assert unbalanced["transport"] == "socket" and "do not balance" in describe_cpu(unbalanced)
    assert "ms_per_mb" not in rebuild_cpu({}, {}, {}, row_bytes=400)  # nothing rebuilt through the fast path
    assert describe_cpu(rebuild_cpu({}, {}, {}, row_bytes=400)) == "no rows through the fast path"


def test_the_records_of_a_run_through_a_failure_are_saved_and_accounted():
    """``--during-training`` keeps every step and the cluster's events; the failure is accounted as in
    ``compare`` (the rate just before the kill)."""
    import types

    from ecrec.bench.accounting import STEP_FIELDS
    from ecrec.bench.recovery_training import saved_records

    records = _records(range(40), gaps={20: 0.5})  # the kill at 2.0 holds up step 20 by 0.5 s (between steps)
    records[20]["start"] -= 0.5  # ... inside the step, as the client's retries do
    event = types.SimpleNamespace(kind="redundant", index=1, wall_time=2.8)
    local = types.SimpleNamespace(cluster_map=lambda: types.SimpleNamespace(events=[event]))
    saved = saved_records(records, local, records[20]["start"], "ecrec")
    assert set(saved["step_records"]) == set(STEP_FIELDS) and len(saved["step_records"]["step"]) == 40
    assert saved["events"] == [{"kind": "redundant", "index": 1, "wall_time": 2.8}]
    figures = saved["accounting"]
    assert figures["samples_per_s_before"] == pytest.approx(100.0)
    assert figures["paused_s"] == pytest.approx(0.5) and figures["lost_training_s"] == pytest.approx(0.5)
    json.dumps(saved)


@pytest.mark.benchmark
@pytest.mark.cluster
def test_full_is_measured_through_its_interval_with_kills_at_stratified_phases(tmp_path, capsys):
    """``full`` meets two kills, at 1/4 and 3/4 of its interval after a save: the later one replays more; a
    standby is started for the second; the cost per day comes from those measured losses."""
    report_path = tmp_path / "r.json"
    rc = cli.main(["recovery", "--rows", "20000", "--dim", "8", "--strategies", "none,full", "--during-training",
                   "--failures", "2", "--mtbf-hours", "0.1", "--before-s", "1.5", "--after-s", "0.5",
                   "--batch-size", "64", "--json", str(report_path)])
    assert rc == 0
    report = json.loads(report_path.read_text())
    full = report["strategies"]["full"]
    failures = full["failures"]
    assert [f["phase"] for f in failures] == [0.25, 0.75]
    assert all(f["replayed_s"] > 0 and f["steps_redone"] > 0 for f in failures)
    assert failures[1]["steps_redone"] > failures[0]["steps_redone"]  # further into the interval: more to redo
    assert full["lost_training_s"] == pytest.approx(np.mean([f["lost_training_s"] for f in failures]))
    assert full["interval"]["how"] == "Daly" and full["interval"]["interval_s"] > 0
    assert len(full["accounting"]["failures"]) == 2 and len(full["kills"]) == 2
    costs = report["cost_per_day"]
    assert set(costs) == {"0.1", "24"}
    by = {c["strategy"]: c for c in costs["24"]}
    assert by["full"]["interval_ratio"] > 1 and by["full"]["cost_s_per_day"] is not None
    assert "expected cost per day of training at an MTBF of 24 h" in capsys.readouterr().out


@pytest.mark.cluster
def test_an_interval_too_long_to_measure_whole_is_refused_with_the_way_out(capsys):
    rc = cli.main(["recovery", "--rows", "2000", "--dim", "8", "--strategies", "full", "--during-training",
                   "--mtbf-hours", "24", "--max-s", "5", "--batch-size", "64"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "full's checkpoint interval at --mtbf-hours 24" in err and "pass a shorter --mtbf-hours" in err
