"""``hierps bench --model dlrm-ref``: every variant in its own process trains the reference DLRM to the
losses plain PyTorch reaches on the same batches, and the report says so."""

from __future__ import annotations

import json

import pytest

from hierps.bench.dlrm_ref import REF_VARIANTS, torchrec_missing
from hierps.cli import main

# torchrec (an optional extra) where it is installed; SGD through FBGEMM's exact_sgd gave torch's
# losses to the bit here, Adagrad's within 6e-8 (FBGEMM sums the same floats in another order)
VARIANTS = list(REF_VARIANTS) if torchrec_missing() is None else [v for v in REF_VARIANTS if v != "torchrec"]


def test_the_dlrm_ref_bench_reports_every_variant_at_torchs_losses(tmp_path, capsys):
    out = tmp_path / "ref.json"
    argv = ["bench", "--model", "dlrm-ref", "--max-ind-range", "200", "--examples", "2048"]
    argv += ["--variants", ",".join(VARIANTS)]
    argv += ["--batch-size", "512", "--pass-batches", "2", "--repeats", "1", "--tmp", str(tmp_path)]
    argv += ["--memory-budget", "64KiB"]  # hierps-ssd's RAM tier: most of the rows on SSD
    assert main([*argv, "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    variants = results["variants"]
    assert list(variants) == VARIANTS
    torch_run = variants["torch"]
    assert len(torch_run["losses"]) == 2 * 4  # a warm-up epoch and a measured one, 4 batches each
    for name, record in variants.items():
        assert "error" not in record, (name, record.get("error"))
        assert record["examples"] == 2048 and record["examples_per_s"] > 0
        assert record["peak_rss_bytes"] > 50 << 20  # VmHWM of its own process: torch is loaded
        assert record["max_loss_diff"] < 1e-5, name
        assert record["final_loss"] == pytest.approx(torch_run["final_loss"], abs=1e-5)
        assert record["vs_torch"] == pytest.approx(record["examples_per_s"] / torch_run["examples_per_s"])
        # every thread's CPU counts, the training thread's among them
        assert record["process_cpu_s"] >= record["train_thread_cpu_s"] * 0.999
        assert record["vs_torch_process_cpu"] == pytest.approx(
            record["examples_per_process_cpu_s"] / torch_run["examples_per_process_cpu_s"]
        )
    ssd, ram = variants["hierps-ssd"], variants["hierps-ram"]
    assert ssd["memory_budget"] == "64KiB" and ram["memory_budget"] >= 64 << 20
    assert ssd["rows_memory"] < ssd["distinct_rows"] == ram["distinct_rows"]
    assert variants["hierps-ram"]["passes"] == 4  # 8 batches in passes of 2
    assert variants["hierps-no-loader"]["passes"] == 0
    table = capsys.readouterr().out
    for name in VARIANTS:
        assert f"\n{name} " in table


def test_the_mlp_only_ceiling_trains_the_dense_part_alone(tmp_path, capsys):
    """``mlp-only``: the model with stand-ins for its tables (no lookup, no sparse step), the most any
    table implementation can reach; its losses are its own, not compared with torch's."""
    out = tmp_path / "ceiling.json"
    argv = ["bench", "--model", "dlrm-ref", "--max-ind-range", "200", "--examples", "2048"]
    argv += ["--variants", "torch,mlp-only", "--optimizer", "adagrad"]
    argv += ["--batch-size", "512", "--repeats", "1", "--tmp", str(tmp_path), "--json", str(out)]
    assert main(argv) == 0
    variants = json.loads(out.read_text())["variants"]
    ceiling, torch_run = variants["mlp-only"], variants["torch"]
    assert "error" not in ceiling, ceiling.get("error")
    assert ceiling["examples"] == 2048 and ceiling["rows"] == 0
    assert ceiling["vs_torch"] == pytest.approx(ceiling["examples_per_s"] / torch_run["examples_per_s"])
    assert len(ceiling["losses"]) == 8 and "max_loss_diff" not in ceiling
    assert ceiling["losses"] != torch_run["losses"]  # the same dense layers, fed no embeddings
    assert "\nmlp-only " in capsys.readouterr().out


def test_without_torchrec_its_variant_is_skipped_with_the_reason(tmp_path, monkeypatch, capsys):
    from hierps.bench import dlrm_ref

    def one_run(spec, timeout):
        assert spec["name"] == "torch"
        record = {"examples_per_s": 10.0, "examples_per_train_cpu_s": 10.0, "peak_rss_bytes": 1 << 20}
        return {**record, "examples": 1, "seconds": 0.1, "losses": [0.5], "final_loss": 0.5}

    monkeypatch.setattr(dlrm_ref, "torchrec_missing", lambda: "torchrec not installed")
    monkeypatch.setattr(dlrm_ref, "spawn", one_run)
    cfg = {"variants": ["torch", "torchrec"], "repeats": 1, "examples": 1, "batch_size": 1}
    cfg |= {"max_ind_range": 1, "optimizer": "sgd", "lr": 0.1, "threads": 1}
    results = dlrm_ref.run_ref_bench(cfg, tmp=str(tmp_path))
    assert results["variants"]["torchrec"] == {"skipped": "torchrec not installed"}
    assert results["variants"]["torch"]["vs_torch"] == 1.0
    lines: list[str] = []
    dlrm_ref.format_report(results, lines.append)
    assert "torchrec           skipped: torchrec not installed" in lines


def test_dropin_and_dlrm_ref_are_two_benches(capsys):
    assert main(["bench", "--dropin", "--model", "dlrm-ref"]) == 2
    assert "Give one of them" in capsys.readouterr().err


def test_device_fraction_is_for_the_dropin_bench_and_positive(capsys):
    assert main(["bench", "--device-fraction", "0.15"]) == 2
    assert "--dropin only" in capsys.readouterr().err
    for bad in ("0", "-1", "x", "inf"):
        with pytest.raises(SystemExit):
            main(["bench", "--dropin", "--device-fraction", bad])
        assert "expected a number > 0" in capsys.readouterr().err


def test_dropin_config_takes_the_device_fraction():
    import argparse

    from hierps.bench.dropin import _config

    empty = dict.fromkeys(("rows", "examples", "batch_size", "pass_batches", "dim", "repeats", "threads"))
    assert _config(argparse.Namespace(**empty, device_fraction=3.0))["device_fraction"] == 3.0
    assert _config(argparse.Namespace(**empty, device_fraction=None))["device_fraction"] == 0.5
