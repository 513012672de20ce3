"""``ecrec-bench compare`` runs the checkpointing baselines the way CPR would (issue 24): CPR's own plan decides
partial or full recovery from the costs it measures, full's interval knows the persist time, checkpoints are one
data file each on a store given by URL, and the report gives the sample-weighted PLS beside the row-update one."""

from __future__ import annotations

import json
import os

import pytest

from baselines import storage
from ecrec.bench import cli


@pytest.mark.benchmark
@pytest.mark.cluster
def test_compare_runs_the_baselines_with_cprs_plan_on_a_checkpoint_url(tmp_path):
    report_path, store = tmp_path / "r.json", tmp_path / "store"
    rc = cli.main(["compare", "--strategies", "full,cpr", "--steps", "140", "--fail-at", "60", "--failures", "1",
                   "--checkpoint-url", f"file://{store}", "--work-dir", str(tmp_path / "work"), "--keep",
                   "--json", str(report_path)])
    assert rc == 0
    report = json.loads(report_path.read_text())
    full, cpr = report["intervals"]["full"], report["intervals"]["cpr"]
    # full: Daly from the measured stall, never below the measured persist time
    assert full["how"] == "Daly" and full["o_persist_s"] > 0 and full["interval_s"] >= full["o_persist_s"]
    assert full["interval_steps"] * full["step_s"] >= full["o_persist_s"]  # the steps too, not only the model
    # cpr: CPR's plan (recovery=auto) chose, from the costs measured on the running cluster
    plan = cpr["plan"]
    # at the quick preset's MTBF (10 s) and PLS (0.01) partial recovery is cheaper for any stall up to 100 ms
    assert plan["recovery"] == "partial" and plan["partial_overhead"] < plan["full_overhead"]
    rows = report["strategies"]
    assert rows["cpr"]["driver"]["mode"] == "partial"
    assert cpr["interval_s"] == pytest.approx(plan["partial_interval_s"])
    # the failure met: its lost samples counted exactly, beside the row updates (each update has >= 1 lookup)
    assert len(rows["cpr"]["failures"]) == 1 and rows["cpr"]["lost_updates"] > 0
    assert rows["cpr"]["lost_samples"] >= rows["cpr"]["lost_updates"] and rows["cpr"]["pls_samples"] > 0
    # the mechanism's memory: plain cpr and full keep nothing per row (the loss accounting is apart)
    assert rows["full"]["memory_mechanism"] == 0 and rows["cpr"]["memory_mechanism"] == 0
    # every checkpoint went to the URL's store, one data file and a manifest each
    for label in ("full", "cpr"):
        root = store / f"ckpt-{label}"
        assert root.is_dir(), sorted(os.listdir(store))
        dirs = [d for s in root.iterdir() for d in s.iterdir() if d.name.startswith("ckpt-")]
        assert dirs and all(sorted(p.name for p in d.iterdir()) == [storage.MANIFEST, storage.PACKED] for d in dirs
                            if (d / storage.MANIFEST).exists())
    assert not any((tmp_path / "work").glob("ckpt-*/server-*"))


def test_compare_refuses_a_store_the_servers_cannot_reach(capsys):
    assert cli.main(["compare", "--strategies", "cpr", "--checkpoint-url", "memory://x"]) == 2
    assert "--checkpoint-url 'memory://x'" in capsys.readouterr().err
    assert cli.main(["compare", "--strategies", "cpr", "--checkpoint-bandwidth-mb-s", "0"]) == 2
    assert "--checkpoint-bandwidth-mb-s must be finite and > 0" in capsys.readouterr().err
