"""``hierps bench --scale`` (hierps.bench.scale): a smoke run, and phases that must not load a table whole.

The 3,000,000-row tests write a store of about 440 MB of rows under a 32MiB RAM budget and a 16MiB
device budget, then run reopen, a training pass + checkpoint, and export, each in a fresh process
(the bench's own phases), and bound each one's peak RSS by that of a bare ``import hierps, torch``
process + 200 MiB: far under the table's bytes, so a phase that reads the whole table (or a key
index proportional to it beyond that) fails. Together they take about 15 s on two cores and a
virtio SSD, so they are not marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hierps.bench import scale
from hierps.cli import main

_MiB = 1 << 20
ROWS = 3_000_000
RSS_ALLOWANCE = 200 * _MiB


def test_scale_bench_smoke(tmp_path: Path) -> None:
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    work = tmp_path / "work"
    work.mkdir()
    argv = ["bench", "--scale", "--sizes", "20000", "--passes", "1", "--disk-bytes", "32MiB"]
    assert main([*argv, "--tmp", str(work), "--json", str(out), "--plot", str(png)]) == 0
    results = json.loads(out.read_text(encoding="utf-8"))
    assert results["disk"]["random_4k"]["reads_per_s"] > 0
    assert results["disk"]["sequential"]["bytes_per_s"] > 0
    [size] = results["sizes"]
    assert size["rows"] == 20_000 and list(size["phases"]) == list(scale.PHASES)
    for phase, record in size["phases"].items():
        assert "error" not in record, (phase, record["error"])
        assert record["seconds"] > 0 and record["peak_rss_bytes"] > 0, phase
        assert record["store"]["files"] > 0 and record["store"]["bytes"] > 0, phase
        assert record["rss_limit_bytes"] == scale.rss_limit(results["config"], 20_000)
    train = size["phases"]["train"]
    [one] = train["passes"]
    assert one["ssd_rows"] > 0 and one["checkpoint_io"]["wchar"] > 0
    assert one["dirty_bytes"] > 16_384 * 32 * 4  # weights, adagrad state and counters of 16384 rows
    assert size["phases"]["reopen"]["num_rows"]["ssd"] == 20_000
    assert size["phases"]["export"]["exported_rows"] == 20_000
    assert [g["key"] for g in results["goals"]] == [key for key, _, _ in scale.GOALS]
    assert png.stat().st_size > 0
    assert not any(work.iterdir())  # stores, exports and probe files deleted without --keep


def test_scale_bench_phases_need_the_write_phase_unless_only_resharding() -> None:
    assert scale._phases("reshard") == ("reshard",)
    assert scale._phases("write,train,reshard") == ("write", "train", "reshard")
    for text in ("train", "reshard,export", ""):
        with pytest.raises(ValueError, match="including write unless only"):
            scale._phases(text)


def test_scale_bench_rejects_sizes_too_small_for_the_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--scale", "--sizes", "20000"]) == 2  # 8 passes of 16384 fresh keys
    assert "fewer --passes" in capsys.readouterr().err


# -- a 3,000,000-row table -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 3M-row store written by the bench's write phase; the phases' settings, paths and RSS bound."""
    root = tmp_path_factory.mktemp("scale-3m")
    cfg = scale.ScaleConfig(sizes=(ROWS,), passes=1, memory_budget="32MiB", device_budget="16MiB")
    conf = scale.phase_config(cfg)
    paths = {"rows": ROWS, "store": str(root / "store"), "export": str(root / "export")}
    written = scale.spawn_phase("write", conf, root / "write", **paths)
    assert "error" not in written, written["error"]
    return {"conf": conf, "paths": paths, "root": root, "bound": scale.bare_import_rss() + RSS_ALLOWANCE}


def _phase(big: dict[str, Any], phase: str) -> dict[str, Any]:
    record = scale.spawn_phase(phase, big["conf"], big["root"] / phase, **big["paths"])
    assert "error" not in record, record["error"]
    return record


def _assert_rss(record: dict[str, Any], big: dict[str, Any], what: str) -> None:
    peak, bound = record["peak_rss_bytes"], big["bound"]
    index = record.get("index_ram_bytes")
    assert peak <= bound, (
        f"{what} of a {ROWS:,}-row table: peak RSS {peak / _MiB:.0f} MiB > {bound / _MiB:.0f} MiB "
        f"(bare import + {RSS_ALLOWANCE // _MiB} MiB) by {(peak - bound) / _MiB:.0f} MiB"
        + ("" if index is None else f"; SSD key index {index / _MiB:.0f} MiB")
    )


@pytest.fixture(scope="module")
def trained(big: dict[str, Any]) -> dict[str, Any]:
    """One pass of 16384 fresh keys + checkpoint, in its own process."""
    return _phase(big, "train")


def test_reopen_does_not_load_the_table(big: dict[str, Any]) -> None:
    record = _phase(big, "reopen")
    assert record["num_rows"]["ssd"] == ROWS
    _assert_rss(record, big, "reopen + num_rows")


def test_training_pass_does_not_load_the_table(big: dict[str, Any], trained: dict[str, Any]) -> None:
    [one] = trained["passes"]
    assert one["ssd_rows"] == 16_384
    _assert_rss(trained, big, "a pass of 16384 fresh keys + checkpoint")


def test_checkpoint_writes_about_the_dirty_rows(trained: dict[str, Any]) -> None:
    [one] = trained["passes"]
    written, dirty = one["checkpoint_io"]["write_bytes"], one["dirty_bytes"]
    assert written <= 4 * dirty + _MiB, (
        f"checkpoint after a pass of 16384 fresh keys on a {ROWS:,}-row table wrote {written / _MiB:.1f} MiB "
        f"= {written / dirty:.1f}x the {dirty / _MiB:.2f} MiB of dirty rows (bound: 4x + 1 MiB)"
    )


def test_export_does_not_load_the_table(big: dict[str, Any]) -> None:
    record = _phase(big, "export")
    assert record["exported_rows"] == ROWS
    _assert_rss(record, big, "export")


def test_a_reshard_into_a_divisor_moves_no_row_and_streamed_writes_each_once(tmp_path: Path) -> None:
    """The bench's reshard phase: 2 -> 1 rank streamed (parts not linkable) writes every row once;
    adopted (rank 1's segments linked in) reads and writes next to nothing; both hold every row."""
    rows = 200_000
    cfg = scale.ScaleConfig(sizes=(rows,), passes=1, memory_budget="32MiB", device_budget="16MiB")
    record = scale.spawn_phase("reshard", scale.phase_config(cfg), tmp_path / "reshard", rows=rows)
    assert "error" not in record, record["error"]
    assert record["rows"] == rows
    stored = rows * record["row_bytes"]
    assert record["reshard_io"]["write_bytes"] >= 0.9 * stored
    assert record["adopted_io"]["write_bytes"] + record["adopted_io"]["read_bytes"] < 0.02 * stored
