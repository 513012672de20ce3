"""docs/results.md is generated: ``ecrec-bench results`` (``ecrec/bench/results_page.py``) renders it from the result
files of docs/results/, and this test fails when the page and the files differ, when a result file is used by no
section, or when the generator would not notice a changed figure.  In one process, no cluster."""

import json
import shutil
from pathlib import Path

import pytest

from ecrec.bench import cli, results_page

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "results.md"


def test_the_page_is_what_the_result_files_render():
    assert results_page.render(RESULTS) == PAGE.read_text(), \
        "docs/results.md is stale: run `ecrec-bench results` (python -m ecrec.bench.cli results)"


def test_every_result_file_is_used_by_a_section_or_listed_as_raw_data():
    used = results_page.used_files(RESULTS)
    files = {p.name for p in RESULTS.glob("*.json")}
    assert files, "no result files"
    assert not files - set(used), f"used by no section: {sorted(files - set(used))}"
    assert set(results_page.RAW) <= files, "RAW lists a file that is not there"
    assert {section for name, section in used.items() if name not in results_page.RAW} <= \
        {title for title, _ in results_page.SECTIONS}
    page = PAGE.read_text()
    for name in files:
        assert f"docs/results/{name}" in page or f"(results/{name})" in page, f"the page never names {name}"
    for image in RESULTS.glob("*.png"):
        assert f"](results/{image.name})" in page, f"the page does not show {image.name}"


def test_the_page_names_the_command_and_load_of_each_section():
    for title, text in results_page.sections(RESULTS)[1:]:
        if title in ("Raw data", "Codec and server throughput"):
            continue
        assert "**Command:** `ecrec-bench " in text, title
        if title != "Production scale, modelled":  # a model: nothing measured, no load to record
            assert "**Load:** load average" in text, title


@pytest.fixture
def results_copy(tmp_path):
    copy = tmp_path / "results"
    shutil.copytree(RESULTS, copy)
    return copy


def _edit(path: Path, change) -> None:
    report = json.loads(path.read_text())
    change(report)
    path.write_text(json.dumps(report))


def test_a_changed_figure_changes_the_page_and_check_names_its_section(results_copy, tmp_path, capsys):
    page = PAGE.read_text()
    _edit(results_copy / "snapshot-4m-1.json", lambda r: r["save"].update(mb_per_s=987.0))
    rendered = results_page.render(results_copy)
    assert rendered != page and "987 MB/s" in rendered
    assert results_page.stale_sections(page, results_copy) == ["Snapshots"]
    assert cli.main(["results", "--dir", str(results_copy), "--out", str(PAGE), "--check"]) == 1
    assert "Snapshots" in capsys.readouterr().err
    out = tmp_path / "results.md"
    assert cli.main(["results", "--dir", str(results_copy), "--out", str(out)]) == 0
    assert out.read_text() == rendered
    assert cli.main(["results", "--dir", str(results_copy), "--out", str(out), "--check"]) == 0

    _edit(results_copy / "compare-quick.json", lambda r: r["strategies"]["ecrec"].update(lost_training_s=9.876))
    assert "9.876" in results_page.render(results_copy)
    stale = results_page.stale_sections(page, results_copy)
    assert stale == ["Every strategy through the same failures (quick preset)", "Snapshots"]


def test_the_page_checks_against_the_repositorys_files_and_a_hand_edit_is_stale(tmp_path, capsys):
    assert cli.main(["results", "--dir", str(RESULTS), "--out", str(PAGE), "--check"]) == 0
    edited = tmp_path / "results.md"
    edited.write_text(PAGE.read_text().replace("## Snapshots\n", "## Snapshots\n\nadded by hand\n"))
    assert cli.main(["results", "--dir", str(RESULTS), "--out", str(edited), "--check"]) == 1
    assert "Snapshots" in capsys.readouterr().err
    assert cli.main(["results", "--dir", str(RESULTS), "--out", str(tmp_path / "missing.md"), "--check"]) == 1


def test_a_result_file_no_section_reads_is_refused(results_copy, capsys):
    (results_copy / "compare-new.json").write_text("{}")
    with pytest.raises(ValueError, match="compare-new.json"):
        results_page.render(results_copy)
    assert cli.main(["results", "--dir", str(results_copy), "--check"]) == 2
    assert "compare-new.json" in capsys.readouterr().err


def test_codec_and_server_files_are_rendered_when_there(results_copy):
    """The two benchmarks without a file here yet: a made-up report of each (the shape their --json writes)."""
    (results_copy / "codec.json").write_text(json.dumps({
        "benchmark": "codec",
        "config": {"size_mib": 16, "k": 4, "m": 2, "backend": "isa_l_rs_vand", "row_bytes": 1024, "repeat": 5,
                   "processor": "test cpu", "cpu_count": 2, "load_average_before": [0.5, 0.4, 0.3],
                   "load_average_after": [0.9, 0.5, 0.3]},
        "figures": [{"op": "delta_batch", "impl": "cpu: isal", "best_gbps": 3.21, "median_gbps": 3.0,
                     "unit": "delta bytes"},
                    {"op": "encode", "impl": "pyeclib isa_l_rs_vand", "best_gbps": 1.5, "median_gbps": 1.4,
                     "unit": "data bytes"}],
        "delta_over_encode": {"cpu: isal": 2.14}}))
    from ecrec.bench import server

    import argparse

    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    config = {**vars(parser.parse_args([])), "json": "server.json", "cpu_count": 2,
              "load_average_before": [0.5, 0.4, 0.3], "load_average_after": [0.9, 0.5, 0.3]}
    (results_copy / "server.json").write_text(json.dumps({
        "config": config,
        "single_server": {"pull_push_rows_per_s": 700_000, "raw_grpc_rows_per_s": 1_100_000, "efficiency": 0.64},
        "cluster": {"sdk_rows_per_s": 350_000, "raw_grpc_rows_per_s": 820_000, "efficiency": 0.43}}))
    text = dict(results_page.sections(results_copy))["Codec and server throughput"]
    assert "ecrec-bench codec --size-mib 16 --k 4 --m 2 --json docs/results/codec.json" in text
    assert "CPU delta update: 3.21 GB/s (target >= 2 GB/s: **met**)" in text
    assert "Bulk encode through pyeclib: 1.50 GB/s (target >= 2 GB/s: **not met**)" in text
    assert "ecrec-bench server --json docs/results/server.json" in text and "reaches 0.64" in text
    assert "700,000" in text and text.count("**Load:**") == 2


def test_the_main_jobs_runs_are_summarised_by_their_median_and_judged_run_by_run(results_copy):
    """Three quick compares: the median and spread of each overhead are recomputed from the files, and "below full
    and cpr in each run" fails when one run is not."""
    base = json.loads((results_copy / "compare-quick.json").read_text())
    for name, wall, cpu in (("compare-quick.json", 0.021, 0.051), ("compare-quick-2.json", -0.013, 0.012),
                            ("compare-quick-3.json", 0.047, 0.024)):
        report = json.loads(json.dumps(base))
        report["strategies"]["ecrec"].update(overhead_vs_none=wall, cpu_overhead_vs_none=cpu)
        report["strategies"]["full"].update(overhead_vs_none=0.2)
        report["strategies"]["cpr"].update(overhead_vs_none=0.03)  # run 3: ecrec above cpr
        (results_copy / name).write_text(json.dumps(report))
    text = dict(results_page.sections(results_copy))["The main job, three runs"]
    assert "median of 3" in text and "+2.1% [-1.3%, +4.7%]" in text and "+2.4% [+1.2%, +5.1%]" in text
    assert "1.024x the reference (target <= 1.03x: **met**)" in text
    assert "overhead +2.1% (target <= 3%: **met**)" in text
    assert "below `full`'s and `cpr`'s in each run: **not met**" in text
    assert "compare-quick-2.json --plot" not in text and "--json docs/results/compare-quick-3.json" in text


def test_the_quick_profiles_are_summarised_by_their_median_and_judged_on_it(results_copy):
    """Three profiles of the quick preset against none (and three of the direct path against the relay): each
    run's figures are the medians over its rounds, the summary their median and spread, and issue 37's target on
    the quick preset is judged on that median, not on the first run."""
    base = json.loads((results_copy / "profile-quick.json").read_text())
    for name, added_ms in (("profile-quick.json", 0.1), ("profile-quick-2.json", 0.5), ("profile-quick-3.json", 0.3)):
        doc = json.loads(json.dumps(base))
        for runs in [doc["runs"], *doc["per_round"]]:  # the strategy's servers cost the baseline's plus added_ms
            servers = runs[doc["strategy"]]["servers_per_step"]
            servers["thread:total"] = runs[doc["against"]]["servers_per_step"]["thread:total"] + added_ms
            servers["rows:pushed"] = 1000.0
        (results_copy / name).write_text(json.dumps(doc))
    text = dict(results_page.sections(results_copy))["The parity path per row update"]
    assert "median of 3" in text and "+0.300 [+0.100, +0.500]" in text
    assert "quick preset (the median of its runs) 0.30 us (**met**)" in text
    assert "profile-quick-relay-3.json" in text and "the rest ratios, direct over relay" in text
    (results_copy / "profile-quick-3.json").unlink()
    (results_copy / "profile-quick-2.json").unlink()  # one run: judged on it, no table of runs
    text = dict(results_page.sections(results_copy))["The parity path per row update"]
    assert "the median of its runs" not in text and "quick preset 0.10 us (**met**)" in text


def test_a_profile_of_ecrec_measured_with_the_relay_says_so_in_its_command(results_copy):
    """A profile of ecrec from before the option ``relay`` (its file names no options) was measured with the relay:
    its command asks for it, the setting it measured; a file that names its options (``profile --json`` writes them
    now) is run as named."""
    title = next(t for t, _ in results_page.sections(results_copy) if t.startswith("What the parity path costs"))
    doc = json.loads((results_copy / "profile-ecrec.json").read_text())
    (results_copy / "profile-ecrec.json").write_text(json.dumps({k: v for k, v in doc.items() if k != "options"}))
    text = dict(results_page.sections(results_copy))[title]
    assert "profile --strategy ecrec --option relay=on --no-py-spy" in text and "was its default" in text
    (results_copy / "profile-ecrec.json").write_text(json.dumps({**doc, "options": {}}))
    text = dict(results_page.sections(results_copy))[title]
    assert "profile --strategy ecrec --no-py-spy" in text and "relay=on" not in text


def _recovery_row(strategy: str, step_ms: list[float], samples_per_s: float) -> dict:
    """A recovery row with step records: ``step_ms`` before the kill at t = 100 s, then a 1 s step after it."""
    start, end, t = [], [], 90.0
    for ms in step_ms + [1000.0]:
        start.append(t)
        end.append(t + ms / 1e3)
        t = end[-1] if len(end) < len(step_ms) else 100.5
    return {"strategy": strategy, "samples_per_s_before": samples_per_s, "kills": [{"time": 100.0}],
            "step_records": {"start": start, "end": end}}


def test_the_runs_at_scale_are_judged_on_the_steps_before_the_kill(results_copy):
    """p99 and stalls come from each file's step records before its first kill (a step after it does not count),
    the samples/s ratio from the rates before it; the median of the runs meets the targets or not."""
    config = {"rows": 4000000, "dim": 64, "fail_server": 1, "failures": 1, "strategies": ["none", "ecrec"],
              "load_average_before": [0.5, 0.4, 0.3], "load_average_after": [1.5, 0.6, 0.4], "cpu_count": 2}
    for i, (slow, rate) in enumerate(((2, 0.96), (0, 0.97), (1, 0.90)), start=1):
        rows = {"none": _recovery_row("none", [10.0] * 100, 1000.0),
                "ecrec": _recovery_row("ecrec", [10.0] * (100 - slow) + [50.0] * slow, 1000.0 * rate)}
        (results_copy / f"recovery-4m-ecrec-{i}.json").write_text(json.dumps({"config": config, "strategies": rows}))
    text = dict(results_page.sections(results_copy))["At scale before a kill, three runs"]
    assert "--strategies none,ecrec --during-training --failures 1 --json docs/results/recovery-4m-ecrec-2.json" in text
    assert "median of 3" in text and "0.96x [0.90x, 0.97x]" in text
    # run 1: 2 steps of 50 ms in 100: p99 5.00x none's, 100 ms of 1080 in stalls; run 3: one, 50 of 1040
    assert "9.3%" in text and "5.00x" in text and "4.8%" in text
    assert "samples/s before the kill 0.96x none's (target >= 0.95x: **met**)" in text
    assert "p99 step 1.04x none's (target <= 1.5x: **met**)" in text  # the median run's: 10.4 ms
    assert "4.8% of ecrec's time in steps over 30 ms (target <= 1%: **not met**)" in text


def test_the_group_size_runs_say_the_group_sizes_and_steps_their_files_measured(results_copy):
    """64-push groups against 16, side by side: the intro's pushes per group and median steps are the files'
    (a run whose groups held 50 pushes widens the range), and without the files the section says nothing."""
    section = "The parity path per row update"
    text = dict(results_page.sections(results_copy))[section]
    assert "profile-quick-coalesce-3.json" in text and "64 minus 16 per row update" in text
    path = results_copy / "profile-quick-coalesce-2.json"
    doc = json.loads(path.read_text())
    servers = doc["runs"][doc["strategy"]]["servers_per_step"]
    servers["strategy:group_pushes"] = 50 * servers["strategy:groups_closed"]
    path.write_text(json.dumps(doc))
    text = dict(results_page.sections(results_copy))[section]
    assert "closes by `coalesce_s`, at 3" in text and "-50 pushes" in text
    for n in (1, 2, 3):
        (results_copy / f"profile-quick-coalesce-{n}.json").unlink()
    assert "64 minus 16" not in dict(results_page.sections(results_copy))[section]


@pytest.mark.parametrize("damage, says", [
    ("dataset", "has no attribute"),  # the preset's "synthetic" for the dataset object: a traceback before
    ("truncated", "compare-quick.json: "),  # cut short: the directory of fifty files was all it named
    ("zero", "division"),           # a zero interval divided by
])
def test_a_damaged_result_file_is_one_line_naming_its_section_and_file(damage, says, results_copy, capsys):
    path = results_copy / "compare-quick.json"
    if damage == "dataset":
        _edit(path, lambda r: r["config"].__setitem__("dataset", "synthetic"))
    elif damage == "truncated":
        path.write_text(path.read_text()[:1000])
    else:
        _edit(path, lambda r: r["intervals"]["cpr"].__setitem__("interval_s", 0))
    assert cli.main(["results", "--dir", str(results_copy), "--check"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "compare-quick.json" in err and says in err, err
