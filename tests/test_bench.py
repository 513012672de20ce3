"""``ecrec-bench codec`` and ``ecrec-bench server`` end to end at a small size, and their argument errors.

The figures themselves are measurements (nothing here asserts a speed); what is asserted is that each command
runs what docs/benchmarks.md says it runs, checks its kernels against each other, and writes a complete report.
"""

from __future__ import annotations

import json

import pytest

from ecrec.bench import cli
from ecrec.coding.kernels import gpu as gpu_mod


def test_codec_bench_measures_every_operation(tmp_path, capsys):
    out = tmp_path / "codec.json"
    assert cli.main(["codec", "--size-mib", "0.25", "--repeat", "1", "--k", "4", "--m", "2", "--kernel", "cpu",
                     "--kernel", "numpy", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "codec"
    assert {k: report["config"][k] for k in ("size_mib", "k", "m", "backend", "row_bytes", "repeat")} == {
        "size_mib": 0.25, "k": 4, "m": 2, "backend": "isa_l_rs_vand", "row_bytes": 1024, "repeat": 1}
    ops = {(f["op"], f["impl"].split(" ")[0]) for f in report["figures"]}
    assert ops == {("delta_batch", "cpu:"), ("delta_stripe", "cpu:"), ("delta_batch", "numpy"),
                   ("delta_stripe", "numpy"), ("encode", "pyeclib"), ("encode_stripes", "pyeclib"),
                   ("reconstruct_1", "pyeclib"), ("reconstruct_2", "pyeclib")}
    assert all(f["best_gbps"] > 0 and f["median_gbps"] > 0 for f in report["figures"])
    encode = next(f["best_gbps"] for f in report["figures"] if f["op"] == "encode")
    for f in report["figures"]:
        if f["op"] == "delta_batch":
            assert report["delta_over_encode"][f["impl"]] == pytest.approx(f["best_gbps"] / encode)
    printed = capsys.readouterr().out
    assert "delta update / pyeclib encode (best GB/s over best GB/s):" in printed and "reconstruct_2" in printed


@pytest.mark.parametrize("argv, message", [
    (["--repeat", "0"], "error: --repeat, --row-bytes and --size-mib must be positive"),
    (["--kernel", "tpu"], "error: unknown kernel 'tpu'"),
    (["--k", "6", "--m", "5"], "not MDS"),
])
def test_codec_bench_argument_errors(argv, message, capsys):
    assert cli.main(["codec", "--size-mib", "0.25", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(gpu_mod.probe()[0], reason="a GPU works here")
def test_codec_bench_refuses_an_explicit_gpu_kernel_without_a_gpu(capsys):
    assert cli.main(["codec", "--size-mib", "0.25", "--kernel", "gpu"]) == 2
    assert f"error: kernel 'gpu' is not available: {gpu_mod.probe()[1]}" in capsys.readouterr().err


@pytest.mark.benchmark
@pytest.mark.cluster
def test_server_bench_compares_with_raw_grpc(tmp_path, capsys):
    out = tmp_path / "server.json"
    assert cli.main(["server", "--servers", "2", "--rows", "2000", "--dim", "8", "--batch", "256", "--seconds", "0.2",
                     "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    single, cluster = report["single_server"], report["cluster"]
    assert single["pull_push_rows_per_s"] > 0 and single["raw_grpc_rows_per_s"] > 0
    assert single["efficiency"] == pytest.approx(single["pull_push_rows_per_s"] / single["raw_grpc_rows_per_s"])
    assert cluster["servers"] == 2 and cluster["sdk_rows_per_s"] > 0
    assert cluster["efficiency"] == pytest.approx(cluster["sdk_rows_per_s"] / cluster["raw_grpc_rows_per_s"])
    printed = capsys.readouterr().out
    assert "one server: pull+push (stubs)" in printed and "2 servers: SDK pull+step" in printed


def test_server_bench_refuses_a_batch_larger_than_the_table(capsys):
    assert cli.main(["server", "--rows", "100", "--batch", "200"]) == 2
    assert "ecrec-bench server: --batch must not exceed --rows" in capsys.readouterr().err


@pytest.mark.benchmark
@pytest.mark.cluster
def test_snapshot_bench_saves_restores_onto_another_shape_and_checks_every_row(tmp_path, capsys):
    out = tmp_path / "snapshot.json"
    assert cli.main(["snapshot", "--rows", "3001", "--dim", "8", "--servers", "3", "--k", "2", "--m", "1",
                     "--restore-servers", "4", "--restore-k", "2", "--restore-m", "2", "--verify", "all",
                     "--dir", str(tmp_path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["exact"] is True and report["saved_exact"] is True
    assert report["parity_mismatched"] == 0 and report["failures_declared"] == 0
    for phase in ("save", "restore"):
        figures = report[phase]
        assert 3001 * 64 < figures["bytes"] < 3001 * 64 + 100_000  # the rows (8 floats and 8 accumulators
        # each) and each item's torch.save framing
        assert figures["mb_per_s"] == pytest.approx(figures["bytes"] / 1e6 / figures["seconds"])
        assert figures["client_peak_bytes"] > 0 and figures["servers_cpu_s"] > 0 and figures["client_cpu_s"] > 0
    assert report["disk_mb_per_s"] > 0 and len(report["load_average_before"]) == 3
    # what each part took: the save's by server part (rows by where they came from), the restore's: the client's
    # check, then the table restored in bulk by the servers (no pushes), their fills by part
    save, restore = report["save"]["parts"], report["restore"]["parts"]
    assert save["bytes"]["own"] + save["bytes"]["delivered"] + save["bytes"]["in_replies"] == 3001 * 64
    assert save["cpu_s"]["checksum"] > 0 and save["cpu_s"]["place"] > 0
    assert {"check_s", "check_cpu_s", "bulk_s", "bulk_fill_s", "servers_fill_s", "servers_rows_cpu_s",
            "servers_parity_cpu_s"} <= set(restore)
    assert restore["check_s"] > 0 and 0 < restore["bulk_fill_s"] <= restore["bulk_s"] <= report["restore"]["seconds"]
    assert "push_s" not in restore  # nothing was left to push
    printed = capsys.readouterr().out
    assert "CPU s by part: own_rows" in printed and "by part: check" in printed and "servers parity cpu" in printed
    assert "restored rows equal: True" in printed
    assert not (tmp_path / "snapshot").exists()  # the snapshot is removed after, the --dir kept
    assert str(tmp_path) not in out.read_text()  # no path of this machine in the report


def test_snapshot_bench_refuses_bad_sizes(capsys):
    assert cli.main(["snapshot", "--rows", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
    # a shape the coordinator would refuse, said before either cluster starts (a traceback from the start before)
    assert cli.main(["snapshot", "--servers", "2", "--k", "2", "--m", "1"]) == 2
    assert "the saving cluster: k + m = 3 exceeds the number of servers (2)" in capsys.readouterr().err
    assert cli.main(["snapshot", "--restore-servers", "3", "--restore-k", "3", "--restore-m", "1"]) == 2
    assert "the restoring cluster: k + m = 4 exceeds" in capsys.readouterr().err
    assert cli.main(["snapshot", "--strategy", "nosuch"]) == 2
    assert "unknown fault-tolerance strategy 'nosuch'" in capsys.readouterr().err
    assert cli.main(["snapshot", "--strategy", "cpr"]) == 2
    assert "--strategy cpr: a checkpointing strategy keeps its own checkpoints" in capsys.readouterr().err
