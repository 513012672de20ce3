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
    # past what one machine runs: they passed every check and started (a review found each)
    (["compare", "--servers", "100000", "--k", "2", "--m", "1"], "--servers 100,000: at most 64"),
    (["compare", "--steps", "99999999999999999999999"], "--steps 99,999,999,999,999,999,999,999: at most"),
    (["compare", "--batch-size", "1000000000000"], "--batch-size 1,000,000,000,000: at most 1,048,576"),
    (["recovery", "--servers", "400", "--rows", "1000"], "--servers 400: at most 64"),
    (["profile", "--servers", "100000", "--no-py-spy"], "--servers 100,000: at most 64"),
    (["profile", "--servers", "0", "--no-py-spy"], "--servers must be >= 1"),  # (it said "--server must be ...")
    (["recovery", "--rows", "1000", "--probe-rows", "1000000000"], "--probe-rows 1,000,000,000: at most "
                                                                      "1,048,576"),
    # a second review: past the servers' bounds for one call (a gRPC traceback once a cluster had started), and
    # process counts with no cap at all
    (["server", "--rows", "2000", "--dim", "65536", "--batch", "1100"], "--batch 1,100 x --dim 65,536: at most "),
    (["server", "--servers", "2000"], "--servers 2,000: at most 64"),
    (["snapshot", "--servers", "2000"], "--servers 2,000: at most 64"),
    (["snapshot", "--restore-servers", "500"], "--restore-servers 500: at most 64"),
    (["control-plane", "--coordinators", "50"], "--coordinators 50: at most 9"),
    (["control-plane", "--etcd-members", "20"], "--etcd-members 20: at most 9"),
    (["compare", "--workers", "500"], "--workers 500: at most 64"),
])
def test_arguments_it_cannot_run_are_refused_in_one_line(argv, says, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


@pytest.mark.parametrize("dataset, says", [
    ("bogus", "unknown --dataset 'bogus'"), ("", "unknown --dataset ''"),
    ("criteo:", "--dataset criteo: names no file"), ("criteo:/nonexistent/day_0", "no such Criteo file"),
    ("criteo:/", "is a directory"),
])
def test_a_dataset_compare_cannot_read_is_refused_before_anything_is_made(dataset, says, monkeypatch, capsys):
    """``--dataset bogus`` (or a Criteo path that is none) printed the run's banner, made its work directory, then
    exited 1; ``--dataset ''`` ran the preset's dataset without a word.  A usage error now: exit 2, nothing made."""
    from ecrec.bench import compare

    monkeypatch.setattr(compare, "prepare_data", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("made")))
    monkeypatch.setattr(compare.tempfile, "mkdtemp", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("made")))
    with pytest.raises(SystemExit) as raised:
        cli.main(["compare", "--strategies", "none", "--dataset", dataset])
    err = capsys.readouterr().err
    assert raised.value.code == 2 and says in str(raised.value) and says in err, (raised.value.code, err)


@pytest.mark.parametrize("argv, says", [
    (["profile", "--dim", "128", "--no-py-spy"], "--dim needs --rows"),
    (["profile", "--dim", "64", "--no-py-spy"], "--dim needs --rows"),  # its default value, given: still ignored
    (["profile", "--batch-size", "64", "--no-py-spy"], "--batch-size needs --rows"),
    (["profile", "--strategy", "none", "--k", "2", "--no-py-spy"], "--k needs an erasure strategy"),
    (["profile", "--strategy", "full", "--option", "interval_steps=100", "--m", "1", "--no-py-spy"], "--m needs an erasure"),
    (["profile", "--server", "0", "--no-py-spy"], "--server needs py-spy's sampling"),
    (["profile", "--to", "5", "--no-py-spy"], "--top needs py-spy's sampling"),  # an abbreviation is the flag
    (["recovery", "--before-s", "3"], "--before-s needs --during-training"),
    (["recovery", "--batch-size", "64", "--strategies", "none"], "--batch-size needs --during-training"),
    (["recovery", "--failures", "1"], "--failures needs --during-training"),
    (["recovery", "--strategies", "full,none", "--k", "3"], "--k needs ecrec among --strategies"),
    (["recovery", "--strategies", "cpr", "--option", "rebuild_slowdown=0.1"], "--option needs ecrec"),
    (["compare", "--strategies", "none,full", "--k", "3"], "--k needs an erasure-coded strategy"),
    (["compare", "--strategies", "none,cpr", "--snapshot-every", "10"], "--snapshot-every needs an erasure-coded"),
    (["compare", "--strategies", "none,ecrec", "--checkpoint-files", "per-table"], "--checkpoint-files needs a "
                                                                                    "checkpointing strategy"),
    (["compare", "--strategies", "ecrec,cpr", "--checkpoint-interval-steps", "50"], "--checkpoint-interval-steps "
                                                                                     "needs full"),
    (["compare", "--strategies", "none,full", "--target-pls", "0.05"], "--target-pls needs a cpr strategy"),
    (["compare", "--strategies", "cpr,cpr-mfu", "--pls-basis", "updates"], "--pls-basis needs --equal-pls"),
    (["compare", "--strategies", "none", "--fail-at", "-1", "--failures", "5"], "--failures needs a failure"),
    (["compare", "--strategies", "none", "--fail-at", "-1", "--fail-server", "2"], "--fail-server needs a failure"),
    (["compare", "--strategies", "none", "--fail-at", "-1", "--rounds", "3"], "--rounds needs side-by-side rounds"),
    (["compare", "--strategies", "none", "--workers", "2", "--rounds", "3"], "--rounds needs side-by-side rounds"),
    (["recovery", "--during-training", "--probe-rows", "7"], "--probe-rows needs an idle run"),
    (["recovery", "--during-training", "--strategies", "ecrec,full", "--target-pls", "0.5"], "--target-pls needs "
                                                                                             "cpr among"),
])
def test_a_flag_its_command_would_ignore_is_refused_by_name(argv, says, monkeypatch, capsys):
    """``profile --dim 128`` without ``--rows`` profiled the quick preset's DLRM, ``recovery --before-s 3`` without
    ``--during-training`` ran the idle rebuild, ``profile --strategy none --k 2`` ran no stripes: each exited 0 as if
    the flag had been used.  Now each is refused, naming what the flag needs, before anything starts."""
    from ecrec.bench import compare, profile_runs, recovery

    def must_not_run(*a, **kw):
        raise AssertionError("started work despite a flag it would ignore")

    monkeypatch.setattr(recovery, "run_strategy", must_not_run)
    monkeypatch.setattr(profile_runs, "workload", must_not_run)
    monkeypatch.setattr(compare, "prepare_data", must_not_run)
    monkeypatch.setattr(compare, "run_strategy", must_not_run)
    monkeypatch.setattr(compare.tempfile, "mkdtemp", must_not_run)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "it would be ignored" in err and "Traceback" not in err, err


def test_flags_given_with_what_they_need_are_taken():
    """The same flags where they apply pass the checks (given_flags sees what the command line set, not the
    defaults)."""
    from ecrec.bench import profile, recovery

    parser = cli.build_parser()
    for argv, check in ((["profile", "--rows", "1000", "--dim", "8", "--batch-size", "64", "--no-py-spy"], profile._check),
                        (["profile", "--strategy", "none", "--against", "ecrec", "--k", "2"], profile._check),
                        (["profile", "--server", "0", "--top", "5"], profile._check),
                        (["recovery", "--during-training", "--before-s", "3", "--failures", "1"], recovery.check_args),
                        (["recovery", "--strategies", "none,ecrec", "--k", "2", "--m", "1"], recovery.check_args),
                        (["recovery", "--rows", "1000"], recovery.check_args),
                        (["recovery", "--rows", "1000", "--probe-rows", "7"], recovery.check_args),
                        (["recovery", "--during-training", "--strategies", "cpr", "--target-pls", "0.05"],
                         recovery.check_args)):
        args = parser.parse_args(argv)
        args._given = cli.given_flags(parser, argv)
        assert not check(args), (argv, check(args))
    assert cli.given_flags(parser, ["recovery", "--rows", "1000"]) == {"command", "rows"}


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


@pytest.mark.parametrize("damage", ["drop", "garble", "lists"])
def test_report_of_a_compare_json_with_a_damaged_config_fails_cleanly(damage, tmp_path, capsys):
    report = json.loads((RESULTS / "compare-quick.json").read_text())
    if damage == "drop":
        del report["config"]["mtbf_s"]
    elif damage == "garble":
        report["config"]["mtbf_s"] = "abc"
    else:  # (a traceback: AttributeError)
        report = {"runs": [], "config": []}
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


def _run_never_reached(argv, monkeypatch) -> None:
    """The sub-command of ``argv`` fails its test if its ``run`` is reached (a refusal there came too late)."""
    import importlib

    def ran(args):
        raise AssertionError(f"ecrec-bench {argv[0]} ran: nothing refused {argv}")

    monkeypatch.setattr(importlib.import_module(cli.SUBCOMMANDS[argv[0]][0]), "run", ran)


@pytest.mark.parametrize("argv, says", [
    (["simulate", "--mtbf-hours", "1e308"], "argument --mtbf-hours: '1e308' must be from 0.001 to 1e+07"),
    (["simulate", "--servers", "8", "--job-mtbf-hours", "1e308"], "argument --job-mtbf-hours: '1e308' must be from"),
    (["simulate", "--servers", "8", "--model-gb", "1e308"], "argument --model-gb: '1e308' must be from 1e-09 to 1e+09"),
    (["simulate", "--servers", "8", "--storage-gbps", "1e-320"], "argument --storage-gbps: '1e-320' must be from"),
    (["simulate", "--servers", "1..2000000"], "server counts must be integers from 1 to 1,000,000"),
    (["profile", "--seconds", "1e308", "--no-py-spy"], "--seconds must be at most 1e+08 seconds, got 1e+308"),
    (["server", "--seconds", "1e9"], "--seconds must be at most 1e+08 seconds"),
    (["recovery", "--after-s", "1e9", "--during-training"], "--after-s must be at most 1e+08 seconds"),
    (["compare", "--cpr-interval-s", "1e9"], "--cpr-interval-s must be at most 1e+08 seconds"),
    (["compare", "--mtbf-hours", "1e5"], "--mtbf-hours must be at most 27777.8 hours (1e+08 s), got 100000"),
    (["report", "x.json", "--cost-mtbf-hours", "1e5"], "--cost-mtbf-hours must be at most 27777.8 hours"),
    (["simulate", "--servers", "8", "--reschedule-s", "1e9"], "--reschedule-s must be at most 1e+08 seconds"),
])
def test_numbers_too_large_to_run_or_to_model_are_refused_naming_the_flag(argv, says, monkeypatch, capsys):
    """``simulate --mtbf-hours 1e308`` (inf once in seconds) and ``--model-gb 1e308`` ended in a ValueError's
    traceback, exit 1; ``profile --seconds 1e308`` was taken and never ended.  Now each is refused before the run."""
    _run_never_reached(argv, monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, says", [
    (["codec", "--size-mib", "1e9", "--repeat", "1"], "--size-mib 1e+09 (--row-bytes 1024, --k 4) needs"),
    (["codec", "--size-mib", "1", "--row-bytes", "100000000000", "--repeat", "1"], "--row-bytes 100000000000"),
    (["simulate", "--servers", "8", "--set", "save_fit_bytes_per_s=1e-300"], "cannot be computed from these inputs"),
    (["recovery", "--rows", "99999999999999", "--strategies", "none"], "more than this machine's"),
    (["snapshot", "--rows", "99999999999999"], "with ecrec's parity (m/k = 1/2), more than this machine's"),
    (["server", "--rows", "99999999999999"], "more than this machine's"),
    (["profile", "--rows", "99999999999999", "--no-py-spy"], "more than this machine's"),
    (["control-plane", "--rows", "99999999999999"], "more than this machine's"),
])
def test_sizes_beyond_this_machines_memory_are_refused_before_anything_starts(argv, says, tmp_path, monkeypatch,
                                                                              capsys):
    """``codec --size-mib 1e9`` failed allocating 954 TiB (a traceback); ``recovery``/``snapshot --rows 1e14``
    started their clusters, then the coordinator's refusal was a ClusterError's traceback (and snapshot left its
    empty temporary directory).  Now each says what it needs and what there is, exit 2, nothing started."""
    import tempfile

    from ecrec.ops import local

    def started(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(local, "LocalCluster", started)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["recovery", "snapshot"])
def test_a_cluster_refusing_the_tables_is_one_line_and_the_temporary_directory_goes(command, tmp_path, monkeypatch,
                                                                                    capsys):
    """What the up-front check cannot see (the coordinator's bound: 60 % of the host's memory per server) came as
    an uncaught ClusterError; now its message, exit 1, the temporary directory removed."""
    import tempfile

    from ecrec.bench import recovery, snapshot
    from ecrec.client import ClusterError

    def refused(*args, **kwargs):
        raise ClusterError("create_table 't0': RESOURCE_EXHAUSTED: table 't0' would need more")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if command == "recovery":
        monkeypatch.setattr(recovery, "run_strategy", refused)
    else:
        monkeypatch.setattr(snapshot, "_cluster", refused)
    assert cli.main([command, "--rows", "100", "--dim", "4"]) == 1
    err = capsys.readouterr().err
    assert f"ecrec-bench {command}: " in err and "RESOURCE_EXHAUSTED" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, says", [
    (["compare", "--json", "/proc/x.json"], "--json /proc/x.json: cannot be created in /proc"),
    (["simulate", "--json", "/proc/x.json"], "--json /proc/x.json: cannot be created in /proc"),
    (["report", "x.json", "--json", "/proc/x.json"], "--json /proc/x.json: cannot be created in /proc"),
    (["recovery", "--plot", "/proc/x.png"], "--plot /proc/x.png: cannot be created in /proc"),
    (["results", "--out", "/proc/results.md"], "--out /proc/results.md: cannot be created in /proc"),
    (["simulate", "--json", ""], "--json is empty; name a file to write"),
    (["compare", "--work-dir", "{file}"], "cannot use --work-dir {file}: {file} is not a directory"),
    (["compare", "--work-dir", "{file}/sub"], "cannot use --work-dir {file}/sub: {file} is not a directory"),
    (["compare", "--work-dir", "/proc/wd"], "cannot use --work-dir /proc/wd:"),
    (["recovery", "--work-dir", "{file}"], "cannot use --work-dir {file}: {file} is not a directory"),
    (["recovery", "--work-dir", "/proc/wd"], "cannot use --work-dir /proc/wd:"),
    (["profile", "--out", "{file}"], "cannot use --out {file}: {file} is not a directory"),
    (["profile", "--out", "/proc/pd"], "cannot use --out /proc/pd:"),
])
def test_files_and_directories_that_cannot_be_written_are_refused_before_the_run(argv, says, tmp_path, monkeypatch,
                                                                                 capsys):
    """Checked with ``os.access``, always true for root and blind to /proc: ``compare --json /proc/x.json`` ran the
    whole benchmark, then failed writing; a ``--work-dir`` that is a file, or in /proc, was a traceback of mkdir
    (``--json ''`` wrote nothing, silently).  Now the file is opened and the directory made (then removed) first."""
    file = tmp_path / "a-file"
    file.write_text("mine")
    argv = [a.replace("{file}", str(file)) for a in argv]
    _run_never_reached(argv, monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert says.replace("{file}", str(file)) in err and "Traceback" not in err, err
    assert file.read_text() == "mine"


def test_the_write_checks_leave_nothing_behind(tmp_path):
    """A file or a directory made to see that it can be leaves no trace; one there before stays as it was."""
    kept = tmp_path / "kept.json"
    kept.write_text("mine")
    parser = cli.build_parser()
    for argv in (["compare", "--json", str(tmp_path / "new.json"), "--work-dir", str(tmp_path / "a" / "b")],
                 ["compare", "--json", str(kept), "--work-dir", str(tmp_path)],
                 ["profile", "--out", str(tmp_path / "prof"), "--json", str(tmp_path / "p.json")]):
        assert cli.check_arguments(parser.parse_args(argv)) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"] and kept.read_text() == "mine"


def test_control_plane_without_etcd_says_so_before_any_cluster_starts(monkeypatch, capsys):
    """Without an etcd binary the file cluster started, then the etcd one failed with FileNotFoundError's
    traceback."""
    from ecrec.ops import local

    def started(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(local, "LocalCluster", started)
    monkeypatch.setenv("ECREC_ETCD", "/nonexistent/etcd")
    assert cli.main(["control-plane", "--rounds", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "ECREC_ETCD=/nonexistent/etcd: no executable file there" in err and "nothing was started" in err, err
    assert "Traceback" not in err


def test_simulate_names_a_from_compare_it_cannot_read(tmp_path, capsys):
    """A directory given to ``--from-compare`` was IsADirectoryError's traceback."""
    assert cli.main(["simulate", "--servers", "8", "--from-compare", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--from-compare {tmp_path}: cannot read it: Is a directory" in err and "Traceback" not in err, err


def test_results_check_writes_nothing_so_needs_no_out_directory_and_names_a_missing_dir(tmp_path, monkeypatch,
                                                                                        capsys):
    """``results --check`` outside the repository was refused for ``--out docs/results.md`` (it writes nothing);
    ``--dir /nonexistent`` was a failure to render, not a flag's error."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["results", "--check", "--dir", str(RESULTS)]) == 1  # the page is read, and missing here
    assert "docs/results.md is stale: cannot read it" in capsys.readouterr().err
    assert cli.main(["results", "--dir", str(tmp_path / "nonexistent"), "--check"]) == 2
    assert f"--dir {tmp_path / 'nonexistent'}: no such directory" in capsys.readouterr().err
    assert cli.main(["results", "--check"]) == 2
    assert "--dir docs/results: no such directory" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["full", "cpr"])
def test_profile_of_a_checkpointing_strategy_on_the_quick_workload_configures_its_cluster(strategy, tmp_path,
                                                                                          monkeypatch):
    """``profile --strategy full`` (or ``--against full``) failed with KeyError 'checkpoint_interval_steps': the
    quick preset lacked a key compare's config adds.  Now its cluster is specified (stopped here, before it starts):
    full saves every few steps unless ``--option interval_steps=N``."""
    from argparse import Namespace

    from ecrec.bench import compare, profile_runs
    from ecrec.ops import local

    specs = []

    class Started(Exception):
        pass

    def start(spec):
        specs.append(spec)
        raise Started

    monkeypatch.setattr(compare, "prepare_data", lambda args, cfg, work: (work / "data.npz", {}))
    monkeypatch.setattr(local, "LocalCluster", start)
    args = Namespace(servers=4, k=2, m=1, rows=None)
    with pytest.raises(Started):
        profile_runs.workload(strategy, args, tmp_path, {})
    from ecrec.bench.compare_running import WARM_SAVE_STEPS

    expected = {"interval_steps": str(WARM_SAVE_STEPS)} if strategy == "full" else {"recovery": "auto"}
    assert expected.items() <= specs[0].options.items(), specs[0].options
    with pytest.raises(Started):
        profile_runs.workload(strategy, args, tmp_path, {"interval_steps": "40"})
    assert specs[1].options["interval_steps"] == "40"


def test_a_run_closes_its_client_after_its_pushes_are_confirmed(tmp_path):
    """Every profile ended with 'closing worker rank0 with N unconfirmed pushes': its client was closed with no
    wait for them (``confirm_timeout_s=0``)."""
    from argparse import Namespace

    from ecrec.bench.compare_running import StrategyRun

    waits = []

    class Client:
        def close(self, confirm_timeout_s=10.0):
            waits.append(confirm_timeout_s)

    class Local:
        def close(self):
            pass

    run = StrategyRun.__new__(StrategyRun)
    run.trainer, run._result, run.local = None, {"cluster": Client()}, Local()
    run.args, run.records_dir = Namespace(keep=False), tmp_path / "records"
    run.close()
    assert waits and 0 < waits[0] <= 10, waits


def test_simulate_names_result_files_it_cannot_read_and_refuses_damaged_figures_in_one_line(tmp_path, capsys):
    """A file of the directory that is no result file (cut short, a list, a config that is a string) was left out
    without a word, or raised AttributeError; figures of the wrong kind raised a traceback."""
    shutil.copy(RESULTS / "compare-quick.json", tmp_path)
    (tmp_path / "cut.json").write_text('{"config": {"comm')
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "named.json").write_text('{"config": "train.yaml"}')
    assert cli.main(["simulate", "--from-results", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "left out, not result files" in err and "cut.json, list.json, named.json" in err, err
    recovery = json.loads((RESULTS / "recovery-4m-ecrec-1.json").read_text())
    recovery["strategies"] = ["ecrec"]
    (tmp_path / "recovery-damaged.json").write_text(json.dumps(recovery))
    assert cli.main(["simulate", "--from-results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "a result file is not as ecrec-bench wrote it" in err and "Traceback" not in err, err


def test_report_of_a_file_with_no_samples_before_a_kill_fails_cleanly(tmp_path, capsys):
    """A rate of zero before a kill was divided by (ZeroDivisionError, a traceback)."""
    report = {"config": {"strategies": [], "fail_at": None},
              "runs": {"reference": {"strategy": "none", "kind": "none", "events": [], "kills": [{"time": 1.5}],
                                     "steps": {"worker": [0, 0, 0], "step": [0, 1, 2], "start": [0, 1, 2],
                                               "end": [1, 2, 3], "samples": [0, 0, 0]}}}}
    path = tmp_path / "zero.json"
    path.write_text(json.dumps(report))
    assert cli.main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cannot recompute" in err and "Traceback" not in err, err
