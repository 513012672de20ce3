"""``ecrec-bench simulate``: the production-scale overhead model against hand-computed values,
``--servers`` parsing, measured-vs-default sourcing from a compare report, and the CLI end to end."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

from baselines import overhead
from ecrec.bench import cli, simulate
from ecrec.bench.simulate import Input


def explicit_inputs(**override) -> dict[str, Input]:
    values = dict(save_bytes_per_s=100e6, full_save_bytes_per_s=100e6, cpr_save_bytes_per_s=100e6,
                  mfu_save_bytes_per_s=100e6, ssu_save_bytes_per_s=100e6, load_bytes_per_s=200e6, reschedule_s=10.0, parity_overhead=0.05,
                  rebuild_bytes_per_s=50e6, recovery_throughput_ratio=0.8, target_pls=0.01,
                  partial_saves_per_interval=4.0, mfu_save_fraction=0.05, mfu_update_coverage=0.5,
                  ssu_save_fraction=0.1, ssu_update_coverage=0.8,
                  # the fit basis (issue 24): no latencies, so o_save = shard / rate as on the overhead basis
                  save_latency_s=0.0, save_fit_bytes_per_s=100e6, stall_latency_s=0.0, load_latency_s=0.0,
                  rebuild_latency_s=0.0, parity_s_per_update=5e-6, updates_per_server_s=10_000.0,
                  snapshot_bytes_per_s=100e6, snapshot_restore_bytes_per_s=200e6)
    values.update(override)
    assert set(values) == set(simulate.DEFAULTS)
    return {k: Input(v, "", "given") for k, v in values.items()}


# --- the model by hand ------------------------------------------------------------------------------
def test_row_by_hand_8_servers_young():
    # 8 servers, per-server MTBF 24 h -> job MTBF 24 * 3600 / 8 = 10800 s; 8 GB model -> 1 GB shard
    row = simulate.simulate_row(8, 24.0, 8e9, explicit_inputs(), formula="young")
    s = row["strategies"]
    assert row["job_mtbf_s"] == pytest.approx(10800.0)
    assert row["shard_bytes"] == pytest.approx(1e9)
    # o_save = 1e9 / 100e6 = 10 s, o_load = 1e9 / 200e6 = 5 s, o_res = 10 s
    # full: T = sqrt(2 * 10 * 10800) = 464.758 s; O = 10/T + (5 + 10 + T/2)/10800
    t = math.sqrt(2 * 10 * 10800)
    assert s["full"]["interval_s"] == pytest.approx(464.758, abs=1e-3)
    assert s["full"]["overhead"] == pytest.approx(10 / t + (5 + 10 + t / 2) / 10800)
    assert s["full"]["overhead"] == pytest.approx(0.044422, abs=1e-6)
    # cpr: T = 2 * 0.01 * 8 * 10800 = 1728 s; O = 10/1728 + (5 + 10)/10800 = 0.0071759; PLS = 0.01
    assert s["cpr"]["interval_s"] == pytest.approx(1728.0)
    assert s["cpr"]["overhead"] == pytest.approx(10 / 1728 + 15 / 10800)
    assert s["cpr"]["overhead"] == pytest.approx(0.0071759, abs=1e-7)
    assert s["cpr"]["pls"] == pytest.approx(0.01)
    assert s["cpr"]["plan"] == "partial"
    # cpr-mfu: f = 0.05, h = 0.5, r = 4: g = 0.5/4 + 0.5 = 0.625; T = 1728 / 0.625 = 2764.8 s
    #   O = 10 * (1 + 3 * 0.05) / 2764.8 + (5 * (1 + 0.15 / 2) + 10) / 10800 = 0.0041594 + 0.0014236
    assert s["cpr-mfu"]["interval_s"] == pytest.approx(2764.8)
    assert s["cpr-mfu"]["overhead"] == pytest.approx(11.5 / 2764.8 + 15.375 / 10800)
    assert s["cpr-mfu"]["overhead"] == pytest.approx(0.0055830, abs=1e-7)
    assert s["cpr-mfu"]["pls"] == pytest.approx(0.01)  # the interval is chosen for the target PLS
    # cpr-ssu: f = 0.1, h = 0.8: g = 0.2 + 0.2 = 0.4; T = 4320 s; O = 10 * 1.3 / 4320 + (5 * 1.15 + 10) / 10800
    assert s["cpr-ssu"]["interval_s"] == pytest.approx(4320.0)
    assert s["cpr-ssu"]["overhead"] == pytest.approx(13 / 4320 + 15.75 / 10800)
    # ecrec: rebuild 1e9 / 50e6 = 20 s, 80 % of training goes on: O = 0.05 + (10 + 0.2 * 20) / 10800
    assert s["ecrec"]["rebuild_s"] == pytest.approx(20.0)
    assert s["ecrec"]["overhead"] == pytest.approx(0.05 + 14 / 10800)
    # none: the reschedule only
    assert s["none"]["overhead"] == pytest.approx(10 / 10800)


def test_row_daly_matches_overhead_module_and_scales_with_servers():
    inputs = explicit_inputs()
    row = simulate.simulate_row(64, 24.0, 8e9, inputs)  # daly by default
    mtbf, o_save, o_load = 24 * 3600 / 64, 8e9 / 64 / 100e6, 8e9 / 64 / 200e6  # 1350 s, 1.25 s, 0.625 s
    t = overhead.daly_interval(o_save, mtbf)
    assert row["strategies"]["full"]["interval_s"] == pytest.approx(t)
    assert row["strategies"]["full"]["overhead"] == pytest.approx(overhead.full_overhead(t, o_save, o_load, mtbf, 10.0))
    # the cpr interval 2 p N mtbf = 2 p * per-server MTBF does not depend on the cluster size
    assert row["strategies"]["cpr"]["interval_s"] == pytest.approx(2 * 0.01 * 24 * 3600)
    assert row["failures_per_day"] == pytest.approx(64.0)


def test_storage_cap_bounds_full_saves_and_rollbacks():
    # 8 GB over 8 servers, store at 0.5 GB/s: a save takes max(1e9/100e6, 8e9/0.5e9) = 16 s;
    # a full rollback loads max(5, 16) = 16 s, a partial reload of one shard max(5, 2) = 5 s
    row = simulate.simulate_row(8, 24.0, 8e9, explicit_inputs(), formula="young", storage_bytes_per_s=0.5e9)
    s = row["strategies"]
    assert s["full"]["o_save_s"] == pytest.approx(16.0)
    assert s["full"]["o_load_s"] == pytest.approx(16.0)
    assert s["cpr"]["o_load_s"] == pytest.approx(5.0)
    t = math.sqrt(2 * 16 * 10800)
    assert s["full"]["overhead"] == pytest.approx(16 / t + (16 + 10 + t / 2) / 10800)


def test_hot_partial_reduces_to_partial_and_validates():
    t, o, pls = simulate.hot_partial_overhead(2.0, 10.0, 3600.0, 4, 0.01, save_fraction=0.05, coverage=0.0)
    assert t == pytest.approx(overhead.interval_for_pls(0.01, 4, 3600.0))  # 288 s
    # zero coverage still pays for the partial saves: 2 * 1.15 / 288 + 10 * 1.075 / 3600
    assert o == pytest.approx(2.3 / 288 + 10.75 / 3600)
    assert pls == pytest.approx(0.01)
    t1, o1, _ = simulate.hot_partial_overhead(2.0, 10.0, 3600.0, 4, 0.01, 0.5, 0.9, partial_per_interval=1)
    assert (t1, o1) == pytest.approx((288.0, overhead.partial_overhead(288.0, 2.0, 10.0, 3600.0)))
    for kw in (dict(save_fraction=1.5), dict(coverage=-0.1), dict(partial_per_interval=0.5)):
        args = dict(save_fraction=0.05, coverage=0.5, partial_per_interval=4.0) | kw
        with pytest.raises(ValueError):
            simulate.hot_partial_overhead(2.0, 10.0, 3600.0, 4, 0.01, **args)
    with pytest.raises(ValueError):
        simulate.ecrec_overhead(0.1, 1.0, 5.0, 1.5, 3600.0)


# --- --servers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("8..1024", [8, 16, 32, 64, 128, 256, 512, 1024]),
    ("10..100", [10, 16, 32, 64, 100]),
    ("8..8", [8]),
    ("8,16,100", [8, 16, 100]),
    ("100, 8,8", [8, 100]),
    ("64", [64]),
])
def test_parse_servers(text, expected):
    assert simulate.parse_servers(text) == expected


@pytest.mark.parametrize("text", ["1024..8", "0..8", "a..b", "", "8,x", "0", "-4,8", "8..", "..8"])
def test_parse_servers_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        simulate.parse_servers(text)


# --- sourcing from a compare report -------------------------------------------------------------------
SHARD = 8 * 20_000 * 16 * 4 * 2 / 4  # 5.12 MB: 8 tables x 20,000 rows x dim 16, Adagrad, over 4 servers


def fake_report(**strategies) -> dict:
    config = {"servers": 4, "k": 2, "m": 1, "steps": 300, "fail_at": 150, "batch_size": 256, "tables": 8,
              "rows_per_table": 20_000, "embedding_dim": 16, "checkpoint_interval_steps": 50,
              "dataset": {"name": "synthetic", "tables": 8, "rows_per_table": 20_000}}
    base = {"none": {"strategy": "none", "promotion_s": 0.05, "overhead_vs_none": 0.01, "pls": 0.12},
            "ecrec": {"strategy": "ecrec", "overhead_vs_none": 0.08, "promotion_s": 0.1, "fully_redundant_s": 0.9,
                      "throughput_during_recovery_ratio": 0.75, "pls": 0.0}}
    base.update(strategies)
    return {"config": config, "reference": {"samples_per_s_failure_free": 5000.0}, "strategies": base}


def test_compare_shard_bytes():
    assert simulate.compare_shard_bytes(fake_report()["config"]) == pytest.approx(SHARD)
    assert simulate.compare_shard_bytes({"servers": 4}) is None


def test_sources_measured_and_default():
    found, missing = simulate.inputs_from_compare(fake_report())
    assert found["parity_overhead"].value == pytest.approx(0.08)
    assert found["reschedule_s"].value == pytest.approx(0.05)  # none's promotion
    # rebuild: shard / (fully_redundant_s - promotion_s) = 5.12e6 / 0.8
    assert found["rebuild_bytes_per_s"].value == pytest.approx(SHARD / 0.8)
    assert found["recovery_throughput_ratio"].value == pytest.approx(0.75)
    assert {found[k].source for k in found} == {"measured"}
    # no full / cpr run: save and load are not measured
    assert "save_bytes_per_s" not in found and "load_bytes_per_s" not in found
    assert any(m.startswith("save_bytes_per_s") for m in missing)
    assert any(m.startswith("load_bytes_per_s") for m in missing)


def test_sources_from_summary_fields():
    report = fake_report(**{
        "full": {"overhead_vs_none": 0.10, "samples_per_s_failure_free": 5000 / 1.1, "promotion_s": 0.06, "pls": 0.0},
        "cpr": {"overhead_vs_none": 0.05, "promotion_s": 0.09, "pls": 0.02},
        "cpr-mfu": {"overhead_vs_none": 0.05, "promotion_s": 0.08, "pls": 0.008},
    })
    found, missing = simulate.inputs_from_compare(report)
    # no driver figures: full's slowdown is put on its saves (modelled):
    # stall per save = 10 % x 50 steps x 256 samples / 5000 samples/s = 0.256 s -> 5.12e6 / 0.256 = 20 MB/s
    assert found["save_bytes_per_s"].value == pytest.approx(SHARD / 0.256)
    assert found["save_bytes_per_s"].source == "modelled"
    # load = cpr promotion - none promotion = 0.04 s (modelled)
    assert found["load_bytes_per_s"].value == pytest.approx(SHARD / 0.04)
    assert found["load_bytes_per_s"].source == "modelled"
    # one failure's PLS is luck: the coverage is never inferred from it; without stats no saved fraction either
    assert not any(k.endswith("_update_coverage") for k in found)
    assert "mfu_save_fraction" not in found
    assert any(m.startswith("mfu_save_fraction") for m in missing)


def test_sources_prefer_driver_and_stats_and_clamp():
    report = fake_report(**{
        "full": {"overhead_vs_none": -0.05, "driver": {"o_save_s": 0.02, "o_load_s": 0.05}},
        "cpr": {"driver": {"o_save_s": 0.04, "o_load_s": 0.01}, "pls": 0.02},
        "cpr-ssu": {"driver": {"o_save_s": 0.03, "o_load_s": 0.03}, "pls": 0.03,
                    "stats": {"0": {"rows_saved_partial": 4000, "partial_saves": 20}, "1": {"error": "x"},
                              "2": {"rows_saved_partial": 4000, "partial_saves": 20}}},
    })
    report["strategies"]["ecrec"].update(overhead_vs_none=-0.02, throughput_during_recovery_ratio=1.3,
                                         stats={"1": {"rows_rebuilt": 40_000, "rebuild_s": 0.5}})
    found, _ = simulate.inputs_from_compare(report)
    assert found["save_bytes_per_s"].value == pytest.approx(SHARD / 0.03)  # median of 0.02, 0.04, 0.03
    assert found["load_bytes_per_s"].value == pytest.approx(SHARD / 0.03)  # median of 0.05, 0.01, 0.03
    assert found["parity_overhead"].value == 0.0 and "clamped" in found["parity_overhead"].note
    assert found["recovery_throughput_ratio"].value == 1.0
    assert found["rebuild_bytes_per_s"].value == pytest.approx(40_000 * 16 * 4 * 2 / 0.5)
    # 8000 rows in 40 partial saves = 200 rows per save over 40,000 rows per shard
    assert found["ssu_save_fraction"].value == pytest.approx(200 / 40_000)
    assert found["save_bytes_per_s"].source == found["load_bytes_per_s"].source == "measured"
    assert "ssu_update_coverage" not in found


def test_not_a_compare_report():
    with pytest.raises(ValueError, match="strategies"):
        simulate.inputs_from_compare({"config": {}})
    # a recovery report has strategies too: it was read, its target PLS taken as the compare run's
    recovery = json.loads((Path(__file__).resolve().parent.parent / "docs" / "results" / "recovery-default.json")
                          .read_text())
    with pytest.raises(ValueError, match="no 'reference' run"):
        simulate.inputs_from_compare(recovery)


# --- CLI end to end ------------------------------------------------------------------------------------
def test_cli_defaults_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert cli.main(["simulate", "--servers", "8..64", "--mtbf-hours", "24", "--model-gb", "8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "default" in printed and "cpr-mfu" in printed
    report = json.loads(out.read_text())
    assert report["config"]["servers"] == [8, 16, 32, 64]
    assert {v["source"] for v in report["inputs"].values()} == {"default"}
    assert set(report["inputs"]) == set(simulate.DEFAULTS)
    assert report["rows_source"] == "modelled"
    assert [r["servers"] for r in report["rows"]] == [8, 16, 32, 64]
    for r in report["rows"]:
        assert set(r["strategies"]) == set(simulate.STRATEGIES)
        assert all(r["strategies"][s]["overhead"] >= 0 for s in simulate.STRATEGIES)


def test_ecrecs_parity_cost_grows_with_m(tmp_path):
    """``--m`` left the parity cost as measured (RS(2, 1)): m = 0, 1 and 2 all paid 10.8 %, and m = 2 came out
    cheaper than m = 1.  Each row update sends its delta to m parity rows: the cost scales with m."""
    parity = {}
    for m in (0, 1, 2):
        out = tmp_path / f"m{m}.json"
        assert cli.main(["simulate", "--servers", "16", "--k", "2", "--m", str(m), "--json", str(out)]) == 0
        parity[m] = json.loads(out.read_text())["rows"][0]["strategies"]["ecrec"]["parity_overhead"]
    assert parity[0] == 0 and parity[1] > 0 and parity[2] == pytest.approx(2 * parity[1])


def test_cli_from_compare_and_overrides(tmp_path, capsys):
    cmp_path, out = tmp_path / "compare.json", tmp_path / "sim.json"
    cmp_path.write_text(json.dumps(fake_report()))
    rc = cli.main(["simulate", "--servers", "8,1024", "--from-compare", str(cmp_path), "--target-pls", "0.02",
                   "--reschedule-s", "60", "--storage-gbps", "10", "--formula", "young", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    inputs = report["inputs"]
    assert inputs["parity_overhead"] == {"value": 0.08, "unit": "fraction", "source": "measured",
                                         "note": "ecrec: overhead_vs_none"}
    assert inputs["save_bytes_per_s"]["source"] == "default"
    assert inputs["target_pls"]["source"] == "given" and inputs["target_pls"]["value"] == 0.02
    assert inputs["reschedule_s"]["source"] == "given" and inputs["reschedule_s"]["value"] == 60.0
    assert any(n.startswith("save_bytes_per_s") for n in report["inputs_not_measured"])
    assert report["config"]["storage_gbps"] == 10 and report["config"]["formula"] == "young"
    assert report["rows"][1]["strategies"]["cpr"]["pls"] == pytest.approx(0.02)
    assert "measured" in capsys.readouterr().out


def test_cli_set_overrides(tmp_path):
    out = tmp_path / "sim.json"
    cpr_cost = simulate.DEFAULTS["cpr_save_bytes_per_s"][0]  # the same cost per save as cpr's
    assert cli.main(["simulate", "--servers", "8", "--set", "mfu_save_fraction=0.05", "--set", "mfu_update_coverage=0",
                     "--set", "partial_saves_per_interval=1", "--set", f"mfu_save_bytes_per_s={cpr_cost}",
                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["inputs"]["mfu_save_fraction"]["value"] == 0.05
    assert report["inputs"]["mfu_save_fraction"]["source"] == "given"
    assert report["inputs"]["ssu_save_fraction"]["source"] == "default"
    s = report["rows"][0]["strategies"]
    assert s["cpr-mfu"]["overhead"] == pytest.approx(s["cpr"]["overhead"])  # r = 1: plain partial recovery


@pytest.mark.slow
def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    assert cli.main(["simulate", "--servers", "8..32", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["--servers", "64..8"], "argument --servers: range '64..8': need 1 <= start <= end"),
    (["--servers", "x"], "argument --servers: 'x': expected a range START..END or a comma list of integers"),
    (["--mtbf-hours", "0"], "argument --mtbf-hours: '0' must be finite and > 0"),
    (["--model-gb", "-1"], "argument --model-gb: '-1' must be finite and > 0"),
    (["--target-pls", "1.5"], "argument --target-pls: '1.5' must be in (0, 1)"),
    (["--formula", "magic"], "argument --formula: invalid choice: 'magic'"),
    (["--storage-gbps", "nan"], "argument --storage-gbps: 'nan' must be finite and > 0"),
    (["--set", "magic=1"], "argument --set: unknown input 'magic'; inputs: save_bytes_per_s,"),
    (["--set", "mfu_save_fraction"], "argument --set: 'mfu_save_fraction': expected NAME=VALUE"),
    (["--set", "mfu_save_fraction=2"], "argument --set: mfu_save_fraction must be in [0, 1], got 2.0"),
    (["--set", "save_bytes_per_s=0"], "argument --set: save_bytes_per_s must be > 0, got 0.0"),
    (["--set", "target_pls=x"], "argument --set: target_pls: 'x' is not a number"),
    (["--set", "partial_saves_per_interval=0.5"], "argument --set: partial_saves_per_interval must be >= 1, got 0.5"),
])
def test_cli_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["simulate", *argv])
    assert exc.value.code == 2
    assert f"ecrec-bench simulate: error: {message}" in capsys.readouterr().err


def test_cli_bad_compare_file(tmp_path, capsys):
    assert cli.main(["simulate", "--from-compare", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli.main(["simulate", "--from-compare", str(bad)]) == 2
    bad.write_text(json.dumps({"config": {}}))
    assert cli.main(["simulate", "--from-compare", str(bad)]) == 2
    assert "not a compare report" in capsys.readouterr().err
    assert cli.main(["simulate", "--reschedule-s", "-1"]) == 2


def test_cli_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    png = tmp_path / "sim.png"
    assert cli.main(["simulate", "--servers", "8", "--plot", str(png)]) == 0
    assert "needs matplotlib" in capsys.readouterr().err
    assert not png.exists()


# --- one cost basis (issue 13) -----------------------------------------------------------------------------
def test_each_checkpointing_strategy_is_charged_its_measured_overhead_per_save():
    report = fake_report(**{
        # full: +6 % at 50 steps of 20 ms = 1 s -> 60 ms per save, above its 12 ms stall
        "full": {"strategy": "full", "overhead_vs_none": 0.06, "median_step_s": 0.02,
                 "interval": {"how": "Daly", "interval_steps": 50, "interval_s": 0.9},
                 "driver": {"o_save_s": 0.012, "o_load_s": 0.03}},
        # cpr: +1 % (within noise) at 0.8 s = 8 ms per save, below its 12 ms stall: the stall is charged
        "cpr": {"strategy": "cpr", "overhead_vs_none": 0.01, "interval": {"how": "target PLS", "interval_s": 0.8},
                "overhead_spread": {"within_noise": True}, "driver": {"o_save_s": 0.012, "o_load_s": 0.03}},
        # cpr-mfu at equal PLS: +4 % at 1.6 s with 3 partial saves of f = 200 / 40,000 each, g = 0.5
        "cpr-mfu": {"strategy": "cpr-mfu", "overhead_vs_none": 0.04,
                    "interval": {"how": "equal PLS (target PLS for cpr)", "interval_s": 1.6, "lost_ratio": 0.5},
                    "stats": {"0": {"rows_saved_partial": 2000, "partial_saves": 10}},
                    "driver": {"o_save_s": 0.012, "o_load_s": 0.03}},
    })
    found, missing = simulate.inputs_from_compare(report)
    assert found["full_save_bytes_per_s"].value == pytest.approx(SHARD / 0.06)
    assert found["full_save_bytes_per_s"].source == "measured"
    assert found["cpr_save_bytes_per_s"].value == pytest.approx(SHARD / 0.012)
    assert "stall" in found["cpr_save_bytes_per_s"].note and "within noise" in found["cpr_save_bytes_per_s"].note
    f = 200 / 40_000
    assert found["mfu_save_fraction"].value == pytest.approx(f)
    assert found["mfu_save_bytes_per_s"].value == pytest.approx(SHARD / (0.04 * 1.6 / (1 + 3 * f)))
    # the coverage that makes the model lose g = h / r + 1 - h of cpr's updates: h = (1 - g) / (1 - 1/r)
    assert found["mfu_update_coverage"].value == pytest.approx(0.5 / 0.75)
    assert found["mfu_update_coverage"].source == "modelled"
    assert found["save_bytes_per_s"].value == pytest.approx(SHARD / 0.012)  # the stall, shown beside
    assert not any(m.startswith("ssu_save_bytes_per_s") for m in missing)  # no cpr-ssu run: nothing to say
    assert simulate.save_cost_from_overhead({"strategy": "x"}, 4, None)[0] is None


def test_stall_only_is_reported_beside_the_overhead_basis():
    inputs = explicit_inputs(full_save_bytes_per_s=20e6, cpr_save_bytes_per_s=50e6)
    row = simulate.simulate_row(8, 24.0, 8e9, inputs, formula="young")
    s = row["strategies"]
    # full: o_save 1e9 / 20e6 = 50 s on the overhead basis, 10 s stall only
    t = math.sqrt(2 * 50 * 10800)
    assert s["full"]["o_save_s"] == pytest.approx(50.0) and s["full"]["o_save_stall_s"] == pytest.approx(10.0)
    assert s["full"]["overhead"] == pytest.approx(50 / t + (5 + 10 + t / 2) / 10800)
    t_stall = math.sqrt(2 * 10 * 10800)
    assert s["full"]["overhead_stall_only"] == pytest.approx(10 / t_stall + (5 + 10 + t_stall / 2) / 10800)
    assert s["cpr"]["overhead"] == pytest.approx(20 / 1728 + 15 / 10800)
    assert s["cpr"]["overhead_stall_only"] == pytest.approx(10 / 1728 + 15 / 10800)


# --- issue 24: the fit basis, CPR's plan, ECRec's data loss, the headline command of docs/results.md ------------
def test_fit_recovers_latency_and_bandwidth_from_synthetic_points():
    lat, bw = 0.134, 80e6
    pts = [(b, lat + b / bw) for b in (0.1e6, 5e6, 50e6, 500e6)]
    fit = simulate.fit_latency_bandwidth(pts)
    assert fit["latency_s"] == pytest.approx(lat, rel=1e-9)
    assert fit["bytes_per_s"] == pytest.approx(bw, rel=1e-9)
    assert fit["rms_relative_residual"] == pytest.approx(0.0, abs=1e-9)
    # a through-the-origin bandwidth (the old approach) would be 5e6 / 0.1965 = 25 MB/s from the 5 MB point alone
    assert 5e6 / (lat + 5e6 / bw) < 0.4 * fit["bytes_per_s"]
    # noisy points: both terms still near the truth
    noisy = [(b, s * f) for (b, s), f in zip(pts, (1.05, 0.97, 1.03, 0.98))]
    fit = simulate.fit_latency_bandwidth(noisy)
    assert fit["latency_s"] == pytest.approx(lat, rel=0.1) and fit["bytes_per_s"] == pytest.approx(bw, rel=0.1)
    with pytest.raises(ValueError, match="two sizes"):
        simulate.fit_latency_bandwidth([(5e6, 0.2), (5e6, 0.3)])
    # no latency in the data: clamped at 0, not negative
    fit = simulate.fit_latency_bandwidth([(1e6, 0.009), (1e7, 0.1), (1e8, 1.0)])
    assert fit["latency_s"] >= 0 and fit["bytes_per_s"] == pytest.approx(1e8, rel=0.05)


def test_plan_picks_full_when_partial_costs_more():
    # a tiny target PLS forces partial saves so often that full recovery is cheaper: the cpr* columns show full
    inputs = explicit_inputs(target_pls=1e-4)
    for row in (simulate.simulate_row_fit(8, 24.0, 8e9, inputs), simulate.simulate_row(8, 24.0, 8e9, inputs)):
        for name in ("cpr", "cpr-mfu", "cpr-ssu"):
            s = row["strategies"][name]
            assert s["plan"] == "full"
            assert s["partial_overhead"] > s["full_overhead"]
            assert s["overhead"] == pytest.approx(s["full_overhead"])
            assert s["pls"] == 0.0
    # and partial where it costs less (the default target)
    s = simulate.simulate_row_fit(8, 24.0, 8e9, explicit_inputs())["strategies"]["cpr"]
    assert s["plan"] == "partial" and s["overhead"] == pytest.approx(s["partial_overhead"])
    assert s["partial_overhead"] < s["full_overhead"]
    assert simulate.plan_min({"overhead": 0.2, "interval_s": 1.0}, {"overhead": 0.1, "interval_s": 2.0})["plan"] == "full"


def test_fit_basis_charges_every_checkpointing_strategy_one_save_cost():
    inputs = explicit_inputs(save_latency_s=2.0, save_fit_bytes_per_s=50e6, full_save_bytes_per_s=1e6)
    s = simulate.simulate_row_fit(8, 24.0, 8e9, inputs, formula="young")["strategies"]
    o = 2.0 + 1e9 / 50e6  # 22 s for every strategy, whatever the per-strategy (overhead basis) rates say
    assert [s[n]["o_save_s"] for n in ("full", "cpr", "cpr-mfu", "cpr-ssu")] == pytest.approx([o] * 4)
    t = math.sqrt(2 * o * 10800)
    assert s["full"]["overhead"] == pytest.approx(o / t + (5 + 10 + t / 2) / 10800)
    # ECRec: parity = 5 us x 10,000 updates/s = 5 %; rebuild of data + parity rows 1e9 x 1.5 / 50e6 = 30 s
    e = s["ecrec"]
    assert e["parity_overhead"] == pytest.approx(0.05)
    assert e["rebuild_s"] == pytest.approx(30.0)
    assert e["overhead_without_loss"] == pytest.approx(0.05 + (10 + 0.2 * 30) / 10800)
    assert e["overhead"] >= e["overhead_without_loss"]


def test_stripe_loss_sets_follow_the_layout():
    # k=2, m=1 on 4 servers: server 0 shares a stripe with 3, 1 (windows {3,0,1}... {0,1,2}): servers 1, 2, 3
    assert simulate.stripe_loss_sets(2, 1, 4) == 3
    # on 100 servers the windows of 3 around server 0 reach 98, 99, 1, 2
    assert simulate.stripe_loss_sets(2, 1, 100) == 4
    # m = 2, k = 2: pairs inside one window of 4 containing server 0: {97,98,99} gives 3 pairs, each later
    # window ({98,99,1}, {99,1,2}, {1,2,3}) 2 new ones
    assert simulate.stripe_loss_sets(2, 2, 100) == 9
    with pytest.raises(ValueError):
        simulate.stripe_loss_sets(4, 1, 4)


def test_data_loss_probability_grows_with_rebuild_time_and_failure_rate():
    day = 86400.0
    p = simulate.data_loss_probability(100.0, day, 2, 1, 64)
    # one failure: 4 neighbours, each fails within 100 s with q = 1 - exp(-100 / 86400)
    q = 1 - math.exp(-100 / day)
    assert p == pytest.approx(1 - (1 - q) ** 4)
    assert simulate.data_loss_probability(1000.0, day, 2, 1, 64) > p  # longer rebuild
    assert simulate.data_loss_probability(100.0, day / 10, 2, 1, 64) > p  # shorter MTBF
    assert simulate.data_loss_probability(100.0, day, 2, 2, 64) < p  # a second parity
    assert simulate.data_loss_probability(0.0, day, 2, 1, 64) == 0.0
    # in the row: a slower rebuild raises the loss probability and what ECRec pays for snapshots
    fast = simulate.simulate_row_fit(64, 24.0, 64e9, explicit_inputs())["strategies"]["ecrec"]
    slow = simulate.simulate_row_fit(64, 24.0, 64e9, explicit_inputs(rebuild_bytes_per_s=1e6))["strategies"]["ecrec"]
    assert slow["data_loss_probability_per_failure"] > fast["data_loss_probability_per_failure"] > 0
    assert slow["snapshot"]["overhead"] > fast["snapshot"]["overhead"] > 0
    assert slow["snapshot"]["interval_s"] < fast["snapshot"]["interval_s"]


def test_snapshot_fallback_by_hand():
    f = simulate.snapshot_fallback(1e-6, 100.0, 50.0, 10.0, formula="young")
    t = math.sqrt(2 * 100 * 1e6)
    assert f["interval_s"] == pytest.approx(t)
    assert f["overhead"] == pytest.approx(100 / t + 1e-6 * (50 + 10 + t / 2))
    assert simulate.snapshot_fallback(0.0, 100.0, 50.0, 10.0)["overhead"] == 0.0


def test_relative_error_to_the_papers_range():
    assert simulate.relative_error(0.083, 0.082, 0.085) == 0.0
    assert simulate.relative_error(0.102, 0.082, 0.085) == pytest.approx(0.2)
    assert simulate.relative_error(0.0053 * 0.5, 0.0053, 0.0068) == pytest.approx(-0.5)


#: the repository root and its measured result files (``ecrec-bench results`` renders them into docs/results.md)
ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def test_defaults_are_what_the_result_files_give():
    found, fits = simulate.measured_results(RESULTS)
    assert set(simulate.REGENERATED) <= set(found)
    for name in simulate.REGENERATED:
        assert simulate.DEFAULTS[name][0] == pytest.approx(found[name].value, rel=2e-3), name
    # the loaded run without paired rounds is left out; the fits say what they were fitted on
    assert "compare-quick-run1.json" in fits["files"]["skipped"]
    # so are runs of another setting than the defaults modelled (a paced rebuild)
    assert "recovery-4m-paced-1.json" in fits["files"]["strategy options set (not the defaults)"]
    assert "recovery-4m-paced-1.json" not in fits["files"]["recovery"]
    assert len(fits["save"]["points"]) >= 4 and len({round(p[0], -5) for p in fits["save"]["points"]}) >= 3
    assert len(fits["parity"]["samples"]) >= 12


#: the command behind docs/results/simulate-cpr-headline.json (docs/results.md, "CPR's headline")
README_COMMAND = ["simulate", "--from-results", "docs/results", "--servers", "8", "--model-gb", "192.5",
                  "--job-mtbf-hours", "20.5", "--target-pls", "0.02", "--paper-check"]


def test_readme_command_reproduces_cprs_headline_within_20_percent(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the repository root, where the documented command runs
    out = tmp_path / "sim.json"
    assert cli.main(README_COMMAND + ["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "CPR's headline" in printed and "8.20-8.50" in printed
    report = json.loads(out.read_text())
    assert report["config"]["basis"] == "fit"
    assert {report["inputs"][n]["source"] for n in simulate.REGENERATED} == {"measured", "modelled"}
    assert {report["inputs"][n]["source"] for n in simulate.REGENERATED if "coverage" not in n} == {"measured"}
    check = report["rows"][0]["paper_check"]
    assert set(check) == {"full", "cpr-mfu", "cpr-ssu"}
    for name, c in check.items():
        assert abs(c["relative_error"]) <= 0.2, (name, c)
    assert check["full"]["simulated"] > 10 * check["cpr-mfu"]["simulated"]
    assert report["fits"]["save"]["latency_s"] > 0


def test_cli_basis_overhead_keeps_the_earlier_model(tmp_path):
    out = tmp_path / "sim.json"
    assert cli.main(["simulate", "--servers", "8", "--basis", "overhead", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    row = report["rows"][0]
    assert row["basis"] == "overhead"
    assert row["strategies"]["ecrec"]["overhead"] >= simulate.DEFAULTS["parity_overhead"][0]
    assert cli.main(["simulate", "--servers", "2", "--k", "2", "--m", "1"]) == 2
    assert cli.main(["simulate", "--from-results", str(tmp_path / "nowhere")]) == 2


def test_the_save_fits_take_one_checkpoint_layout(tmp_path):
    """Packed saves (files=one) are a different cost: the per-table fits leave them out (ECRec's inputs still take
    those reports), and a fit of the packed layout alone needs two sizes."""
    assert simulate.checkpoint_layout({"checkpoint_files": "one"}) == "one"
    assert simulate.checkpoint_layout({"option": ["interval_s=2", "files=one"]}) == "one"
    assert simulate.checkpoint_layout({}) == "per-table"
    import shutil
    for p in RESULTS.glob("*.json"):
        if "realistic" not in p.name:
            shutil.copy(p, tmp_path / p.name)
    without, fits_without = simulate.measured_results(tmp_path)
    found, fits = simulate.measured_results(RESULTS)
    assert {"compare-realistic.json", "compare-realistic-run1.json"} <= set(fits["files"]["other checkpoint layout"])
    for key in ("save", "stall", "load"):
        assert fits[key]["points"] == fits_without[key]["points"], key
        assert not any("realistic" in p[2] for p in fits[key]["points"])
    assert any("realistic" in p[2] for p in fits["rebuild"]["points"])  # ECRec's rebuilds do not depend on it
    assert len(fits["parity"]["samples"]) > len(fits_without["parity"]["samples"])
    packed, fits_packed = simulate.measured_results(RESULTS, layout="one")
    assert "error" in fits_packed["save"] and "save_fit_bytes_per_s" not in packed  # 5.2 MB only: not fitted
    packed_files = {p.name for p in RESULTS.glob("compare-*.json")
                    if simulate.checkpoint_layout(json.loads(p.read_text())["config"]) == "one"}
    assert {"compare-realistic.json", "compare-quick.json"} <= packed_files
    assert all(any(name in p[2] for name in packed_files) for p in fits_packed["save"]["points"])
    assert not any("per-table" in p[2] for p in fits_packed["save"]["points"])


def test_a_fit_over_sizes_a_few_per_cent_apart_is_refused():
    with pytest.raises(ValueError, match=r"two sizes a factor 2 or more apart.*5.2-5.3 MB"):
        simulate.fit_latency_bandwidth([(5.2e6, 0.03), (5.25e6, 0.04), (5.3e6, 0.035)])
    with pytest.raises(ValueError, match="got none"):
        simulate.fit_latency_bandwidth([])
    assert simulate.fit_latency_bandwidth([(5e6, 0.1), (10e6, 0.15)])["bytes_per_s"] == pytest.approx(1e8)
