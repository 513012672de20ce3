"""``ecrec-bench``'s sub-commands refuse what they cannot run -- before any process starts -- with one line that
names the flag and exit status 2, never a traceback; and what they do run keeps what the user asked to keep."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ecrec.bench import cli

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


@pytest.mark.parametrize("argv, says", [
    (["compare", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["compare", "--steps", "0"], "--steps must be at least 1"),
    (["compare", "--servers", "0"], "--servers must be at least 1"),
    (["compare", "--k", "0"], "--k and --m must be at least 1"),
    (["compare", "--strategies", ""], "--strategies is empty"),
    (["server", "--batch", "0"], "--batch must be at least 1"),
    (["server", "--rounds", "0"], "--rounds must be at least 1"),
    (["server", "--servers", "0"], "--servers must be at least 1"),
    (["server", "--seconds", "0"], "--seconds must be positive"),
    (["server", "--rows", "0"], "--rows must be at least 1"),
    (["server", "--rows", "10", "--batch", "20"], "--batch must not exceed --rows (20 > 10)"),
    (["control-plane", "--servers", "2"], "exceeds the number of servers"),
    (["profile", "--strategy", "full", "--rows", "3", "--no-py-spy"], "needs an interval"),
    (["recovery", "--rows", "10", "--failures", "2"], "--failures needs --during-training"),
    (["codec", "--k", "0", "--size-mib", "1"], "--k and --m must be at least 1"),
    (["compare", "--strategies", "none,ecrec,none"], "--strategies lists a strategy twice"),
    (["simulate", "--from-results", str(RESULTS / "compare-quick.json")], "a file, not a directory of result files"),
])
def test_arguments_it_cannot_run_are_refused_in_one_line(argv, says, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, says", [
    (["profile", "--seconds", "nan", "--no-py-spy"], "--seconds must be a finite number, got nan"),
    (["profile", "--seconds", "inf", "--no-py-spy"], "--seconds must be a finite number, got inf"),
    (["recovery", "--cost-mtbf-hours", "inf"], "--cost-mtbf-hours must be a finite number, got inf"),
    (["recovery", "--before-s", "inf", "--during-training"], "--before-s must be a finite number, got inf"),
    (["codec", "--size-mib", "nan"], "--size-mib must be a finite number, got nan"),
    (["snapshot", "--json", "{tmp}/missing/x.json"], "--json {tmp}/missing/x.json: no directory {tmp}/missing"),
    (["compare", "--json", "{tmp}"], "--json {tmp}: is a directory"),
    (["simulate", "--plot", "{tmp}/missing/x.png"], "--plot {tmp}/missing/x.png: no directory"),
    (["results", "--out", "{tmp}/missing/results.md"], "--out {tmp}/missing/results.md: no directory"),
])
def test_numbers_that_are_not_finite_and_files_that_cannot_be_written_are_refused_before_the_run(
        argv, says, tmp_path, capsys):
    """NaN passed every ``<= 0`` check (``profile --seconds nan`` exited 0 with 0 steps of made-up figures) and inf
    ran for ever or failed after the whole run; a ``--json`` or ``--plot`` in a missing directory failed with a
    traceback after the run, its figures lost.  Now each is one line and exit 2 before anything starts."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert says.replace("{tmp}", str(tmp_path)) in err and "Traceback" not in err, err


@pytest.mark.cluster
def test_a_snapshot_bench_whose_servers_cannot_write_says_so_in_one_line(capsys):
    """``snapshot --dir /proc``: a traceback of the SDK's SnapshotError; now its message, exit 1."""
    assert cli.main(["snapshot", "--rows", "200", "--dim", "4", "--dir", "/proc"]) == 1
    err = capsys.readouterr().err
    assert "ecrec-bench snapshot: snapshot to /proc/snapshot" in err and "Traceback" not in err, err


@pytest.mark.cluster
def test_recovery_removes_the_checkpoints_it_wrote_under_a_work_dir_unless_kept(tmp_path):
    """``recovery --work-dir DIR`` left ``DIR/ckpt-full/...`` (a model's size) although only ``--keep`` keeps
    what a run writes; now they go, and what DIR held before stays."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.txt").write_text("kept")
    argv = ["recovery", "--rows", "2000", "--dim", "4", "--strategies", "full", "--work-dir", str(work)]
    assert cli.main(argv) == 0
    assert sorted(p.name for p in work.iterdir()) == ["mine.txt"]
    assert cli.main([*argv, "--keep"]) == 0
    assert "mine.txt" in {p.name for p in work.iterdir()} and len(list(work.iterdir())) > 1


@pytest.mark.cluster
def test_a_profile_without_out_leaves_no_temporary_files(tmp_path, monkeypatch):
    """Without ``--out`` every profile left its temporary directory, the clusters' checkpoints in it (30 MB for a
    10 MB table); now it goes, but for py-spy's collapsed stacks when there are any."""
    import tempfile

    made = []
    real = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        made.append(Path(real(*args, dir=str(tmp_path), **{k: v for k, v in kwargs.items() if k != "dir"})))
        return str(made[-1])

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    assert cli.main(["profile", "--strategy", "full", "--rows", "2000", "--seconds", "1", "--rounds", "1",
                     "--no-py-spy", "--option", "interval_s=0.3"]) == 0
    profile_dirs = [p for p in made if p.name.startswith("ecrec-profile-")]
    assert len(profile_dirs) == 1 and not profile_dirs[0].exists(), list(profile_dirs[0].rglob("*"))


def test_simulate_refuses_a_results_directory_with_nothing_to_read(tmp_path, capsys):
    assert cli.main(["simulate", "--from-results", str(tmp_path)]) == 2
    assert "no result file there gives any input" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["drop", "garble"])
def test_report_of_a_compare_json_with_a_damaged_config_fails_cleanly(damage, tmp_path, capsys):
    report = json.loads((RESULTS / "compare-quick.json").read_text())
    if damage == "drop":
        del report["config"]["mtbf_s"]
    else:
        report["config"]["mtbf_s"] = "abc"
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert cli.main(["report", str(path)]) == 2
    out = capsys.readouterr()
    assert "cannot recompute" in out.err and out.out == ""  # nothing half printed


def test_codec_runs_a_code_of_one_data_row(capsys):
    assert cli.main(["codec", "--k", "1", "--m", "1", "--size-mib", "0.25", "--repeat", "1"]) == 0


def test_recovery_says_later_not_a_fraction_sooner():
    from ecrec.bench.recovery import _how_much_sooner

    assert _how_much_sooner(1.0, 2.5) == "2.50x sooner"
    assert _how_much_sooner(0.55, 0.04) == "13.75x later"


@pytest.mark.cluster
def test_snapshot_bench_keeps_the_snapshot_when_asked(tmp_path, capsys):
    keep = tmp_path / "mine"
    assert cli.main(["snapshot", "--rows", "50", "--dim", "2", "--servers", "3", "--restore-servers", "3",
                     "--dir", str(keep), "--keep"]) == 0
    assert (keep / "snapshot").is_dir() and any((keep / "snapshot").iterdir())
    assert "kept in" in capsys.readouterr().out
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert cli.main(["snapshot", "--rows", "50", "--dim", "2", "--dir", str(blocked / "sub")]) == 2
    assert "cannot use --dir" in capsys.readouterr().err
    shutil.rmtree(keep)


@pytest.mark.cluster
def test_a_snapshot_path_every_server_cannot_reach_alike_is_refused_and_nothing_written(make_cluster, tmp_path,
                                                                                          monkeypatch):
    """An empty path (an unset variable) wrote every server's part into its working directory and reported
    success; a ``memory://`` URL wrote each part into one process's memory: neither could be read back."""
    from ecrec.client import Cluster
    from ecrec.snapshot import SnapshotError

    local = make_cluster(servers=2)
    client = Cluster.connect(local.coordinator_address)
    try:
        client.create_table("t", 10, 2)
        monkeypatch.chdir(tmp_path)
        for path in ("", "  ", "memory://snap"):
            with pytest.raises(SnapshotError, match="empty|memory filesystem"):
                client.save(path)
            with pytest.raises(SnapshotError, match="empty|memory filesystem"):
                client.load(path)
        assert list(tmp_path.iterdir()) == []
    finally:
        client.close()


def test_recoverys_cost_table_says_why_it_is_empty_without_none(capsys):
    """Without ``none`` in the run every cost cell is ``-`` and nothing said why (only ``--help`` did)."""
    from ecrec.bench import recovery

    report = json.loads((RESULTS / "recovery-4m-through-1.json").read_text())
    rows = list(report["strategies"].values())
    assert [r["strategy"] for r in rows] == ["ecrec"]
    recovery.print_report(rows, True, report["cost_per_day"])
    assert "no 'none' run here: no overhead, so no cost (add none to --strategies)" in capsys.readouterr().out
