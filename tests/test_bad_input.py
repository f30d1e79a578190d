"""Every public entry point, tried with the kinds of values users get wrong.

Each bad value raises an error of :mod:`hierps.errors` naming the problem, at the call that got
it (not at some later valid call), and leaves the store as it was: its rows, its checkpoints, and
every later checkpoint and reopening still work.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hierps
from hierps import errors

KEYS = np.arange(0, 40, dtype=np.int64)


def _still_whole(store: hierps.Store, rows: np.ndarray) -> None:
    """Rows as before; a checkpoint and a reopening after the refusal both work."""
    np.testing.assert_array_equal(store.read_rows("t", KEYS), rows)
    ckpt = store.checkpoint(tag="after")
    path = store.path
    store.close()
    with hierps.Store(path, device="cpu") as again:
        assert again.checkpoint_id == ckpt
        np.testing.assert_array_equal(again.read_rows("t", KEYS), rows)


def _whole(store: hierps.Store, keys: list[int]) -> np.ndarray:
    """Whole decoded rows of ``keys`` as ``write_rows`` takes them: weights, optimizer state (as
    read) and counters (zeros)."""
    rows = store.read_rows("t", np.array(keys))
    return np.hstack([rows, np.zeros((len(keys), store.tables["t"].width - rows.shape[1]), np.float32)])


def _with(rows: np.ndarray, at: tuple[int, int], value: float) -> np.ndarray:
    """A copy of decoded ``rows`` with one value replaced."""
    out = rows.copy()
    out[at] = value
    return out


# Each: (what, call(store, bag), error, message).
CASES: list[tuple[str, Callable[[hierps.Store, Any], Any], type[Exception], str]] = [
    ("int tag", lambda s, b: s.checkpoint(tag=1000), errors.ConfigError, "tag: expected a str"),
    ("float tag", lambda s, b: s.checkpoint(tag=1.5), errors.ConfigError, "tag: expected a str"),
    ("set extra", lambda s, b: s.checkpoint(extra={"a": {1, 2}}), errors.ConfigError, "JSON object"),
    ("int-keyed extra", lambda s, b: s.checkpoint(extra={1: 2}), errors.ConfigError, "JSON object"),
    ("nan extra", lambda s, b: s.checkpoint(extra={"x": float("nan")}), errors.ConfigError, "JSON"),
    ("list extra", lambda s, b: s.checkpoint(extra=[1]), errors.ConfigError, "JSON object"),
    ("restore(True)", lambda s, b: s.restore(True), errors.ConfigError, "checkpoint id"),
    ("restore(1.0)", lambda s, b: s.restore(1.0), errors.ConfigError, "checkpoint id"),
    ("restore(unknown)", lambda s, b: s.restore("nope"), errors.ConfigError, "no checkpoint 'nope'"),
    ("NUL table", lambda s, b: s.table("a\0b", 4), errors.ConfigError, "NUL"),
    ("long table", lambda s, b: s.table("é" * 128, 4), errors.ConfigError, "255 bytes"),
    ("zarr.json table", lambda s, b: s.table("zarr.json", 4), errors.ConfigError, "zarr.json"),
    ("manifest table", lambda s, b: s.table("Manifest.json", 4), errors.ConfigError, "manifest.json"),
    ("surrogate table", lambda s, b: s.table("a\udc80", 4), errors.ConfigError, "UTF-8"),
    ("int table", lambda s, b: s.table(3, 4), errors.ConfigError, "a str"),
    ("huge dim", lambda s, b: s.table("big", 10**9), errors.ConfigError, "from 1 to 65536"),
    ("bool dim", lambda s, b: s.table("big", True), errors.ConfigError, "dim"),
    ("list of ints pass", lambda s, b: s.begin_pass([1, 2, 3]), errors.InvalidIdsError, "batches"),
    ("int pass", lambda s, b: s.begin_pass(5), errors.InvalidIdsError, "batches"),
    ("str pass", lambda s, b: s.begin_pass("t"), errors.InvalidIdsError, "batches"),
    ("float prefetch", lambda s, b: s.prefetch({"t": np.array([1.5])}), errors.InvalidIdsError, "float"),
    ("ragged ids", lambda s, b: s.lookup("t", [[1], [2, 3]]), errors.InvalidIdsError, "integer ids"),
    ("unknown table pass", lambda s, b: s.begin_pass({"u": [1]}), errors.ConfigError, "unknown table"),
    (
        "sparse ids",
        lambda s, b: b(torch.tensor([1, 2]).to_sparse(), torch.tensor([0])),
        errors.InvalidIdsError,
        "dense",
    ),
    (
        "sparse lookup",
        lambda s, b: s.lookup("t", torch.tensor([1, 2]).to_sparse()),
        errors.InvalidIdsError,
        "dense",
    ),
    (
        "int weights",
        lambda s, b: b(torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=torch.tensor([1, 2])),
        errors.OffsetsError,
        "float tensor",
    ),
    (
        "complex weights",
        lambda s, b: b(
            torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=torch.ones(2, dtype=torch.complex64)
        ),
        errors.OffsetsError,
        "float tensor",
    ),
    (
        "str weights",
        lambda s, b: b(torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights="ab"),
        errors.OffsetsError,
        "dense float tensor",
    ),
    ("write_rows list", lambda s, b: s.write_rows("t", [1], [[0.0]]), errors.ConfigError, "rows of shape"),
    ("write_rows str", lambda s, b: s.write_rows("t", [1], "rows"), errors.ConfigError, "real numbers"),
    ("write str", lambda s, b: s.write("t", [1], [["a"] * 4]), errors.ConfigError, "real numbers"),
    (
        "write_rows repeated key",
        lambda s, b: s.write_rows("t", [7, 3, 7], _whole(s, [7, 3, 7])),
        errors.ConfigError,
        "keys must be unique; key 7 appears more than once",
    ),
    (
        "write_rows NaN",
        lambda s, b: s.write_rows("t", [3, 4], _with(_whole(s, [3, 4]), (1, 2), np.nan)),
        errors.ConfigError,
        "row 1 holds nan in column 2; rows must be finite",
    ),
    (
        "write_rows inf counter",
        lambda s, b: s.write_rows("t", [3], _with(_whole(s, [3]), (0, 9), np.inf)),
        errors.ConfigError,
        "row 0 holds inf in column 9",
    ),
    (
        "write_rows beyond float32",
        lambda s, b: s.write_rows("t", [3], _with(_whole(s, [3]).astype(np.float64), (0, 0), 1e39)),
        errors.ConfigError,
        "holds 1e\\+39 in column 0; rows must be finite float32",
    ),
    (
        "write_rows negative adagrad sum",
        lambda s, b: s.write_rows("t", [3], _with(_whole(s, [3]), (0, 5), -0.5)),
        errors.ConfigError,
        "column 5, its adagrad state 'sum': a sum of squared gradients, which cannot be negative",
    ),
    ("num_rows unknown table", lambda s, b: s.num_rows("nope"), errors.ConfigError, "unknown table 'nope'"),
    ("end_pass outside a pass", lambda s, b: s.end_pass(), errors.ConfigError, "end_pass: no pass is open"),
    ("retire keep str", lambda s, b: s.retire_checkpoints("x"), errors.ConfigError, "keep is a str"),
    ("retire keep int", lambda s, b: s.retire_checkpoints(1), errors.ConfigError, "keep is a int"),
    ("retire unknown id", lambda s, b: s.retire_checkpoints([999]), errors.ConfigError, "no checkpoint 999"),
    ("retire bool id", lambda s, b: s.retire_checkpoints([True]), errors.ConfigError, "keep holds True"),
    ("retire float id", lambda s, b: s.retire_checkpoints([1.0]), errors.ConfigError, "keep holds 1.0"),
    ("observe click 2", lambda s, b: s.observe("t", [1, 2], [0, 2]), errors.ConfigError, "click label 2.0"),
    (
        "observe click -1",
        lambda s, b: s.observe("t", [1, 2], [-1, 1]),
        errors.ConfigError,
        "click label -1.0",
    ),
    (
        "observe click 0.5",
        lambda s, b: s.observe("t", [1], [0.5]),
        errors.ConfigError,
        "clicked \\(1\\) or not",
    ),
    ("observe str clicks", lambda s, b: s.observe("t", [1], ["yes"]), errors.ConfigError, "must be numbers"),
    (
        "another initializer",
        lambda s, b: s.table("t", 4, initializer="zeros"),
        errors.TableMismatchError,
        "cannot follow a new initializer",
    ),
    *(
        (
            f"{opt} eps 0",
            lambda s, b, opt=opt: s.table("u", 4, optimizer={"type": opt, "params": {"eps": 0}}),
            errors.ConfigError,
            message,
        )
        for opt, message in (
            ("partial_rowwise_adam", "partial_rowwise_adam needs eps > 0"),
            ("adam", "adam needs eps > 0"),
            ("adagrad", "adagrad needs eps > 0 or initial_accumulator_value > 0"),
            ("rowwise_adagrad", "rowwise_adagrad needs eps > 0"),
        )
    ),
    (
        "write complex",
        lambda s, b: s.write("t", [1], np.ones((1, 4), np.complex64)),
        errors.ConfigError,
        "real numbers",
    ),
]


@pytest.mark.parametrize("what, call, error, message", CASES, ids=[c[0] for c in CASES])
def test_bad_values_are_refused_where_given(trained, what, call, error, message):
    store, bag = trained
    rows = store.read_rows("t", KEYS).copy()
    with pytest.raises(error, match=message):
        call(store, bag)
    _still_whole(store, rows)


def test_float64_per_sample_weights_pool_like_float32(trained):
    store, bag = trained
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 2])
    weights = torch.tensor([0.5, 2.0, 1.0])
    with torch.no_grad():
        want = bag(ids, offsets, per_sample_weights=weights)
        got = bag(ids, offsets, per_sample_weights=weights.double())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_int_tag_as_a_string_round_trips(trained):
    store, _ = trained
    ckpt = store.checkpoint(tag="1000")
    assert store.restore("1000") == ckpt
    assert store.list_checkpoints()[-1]["tag"] == "1000"


@pytest.mark.parametrize(
    "device, message",
    [
        ("tpu", "expected a device"),
        ("", "expected a device"),
        ("cpu:1", "no index"),
        ("meta", "cpu or cuda"),
        (3, "expected a device"),
    ]
    + ([("cuda", "no CUDA GPU")] if not torch.cuda.is_available() else [("cuda:99", "CUDA GPU")]),
)
def test_bad_devices(tmp_path, device, message):
    with pytest.raises(errors.ConfigError, match=message):
        hierps.Store(tmp_path / "s", device=device)
    assert not (tmp_path / "s").exists()  # refused before anything is created


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seed": "abc"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"keep_checkpoints": True}, "keep_checkpoints"),
        ({"keep_checkpoints": 0}, "keep_checkpoints"),
        ({"max_segments": True}, "max_segments"),
        ({"memory_budget": "lots"}, "memory_budget"),
        ({"pipeline": 1}, "pipeline"),
    ],
)
def test_bad_settings_of_every_kind(tmp_path, kwargs, message):
    with pytest.raises(errors.ConfigError, match=message):
        hierps.Store(tmp_path / "s", device="cpu", **kwargs)


def _paths(tmp_path: Path) -> list[tuple[str, str]]:
    (tmp_path / "file").write_text("x")
    out = [
        ("under a file", str(tmp_path / "file" / "store")),
        ("with a NUL byte", str(tmp_path / "a\0b")),
        ("too long", str(tmp_path / ("x" * 300))),
    ]
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if not os.access(ro, os.W_OK):  # root writes anywhere: the read-only case needs a normal user
        out.append(("read-only", str(ro / "store")))
    return out


def test_store_paths_that_cannot_hold_a_store(tmp_path):
    for what, path in _paths(tmp_path):
        with pytest.raises(errors.ConfigError, match="store path") as info:
            hierps.Store(path, device="cpu")
        assert "cannot be" in str(info.value) or "not a valid path" in str(info.value), what


def test_a_read_only_file_system_is_a_clear_error(tmp_path):
    """A store on a read-only mount (bind-mounted read-only where permitted)."""
    target = tmp_path / "ro"
    target.mkdir()
    if os.system(f"mount --bind -o ro {target} {target} 2>/dev/null") != 0:
        pytest.skip("mount is not permitted here")
    try:
        with pytest.raises(errors.ConfigError, match="store path.*Read-only file system"):
            hierps.Store(target / "store", device="cpu")
    finally:
        os.system(f"umount {target}")


def test_checkpoint_reader_closes_its_files(trained):
    store, _ = trained
    with hierps.CheckpointReader(store.path) as reader:
        found, _ = reader.read("t", KEYS)
        assert found.sum() == 32 and len(reader.ssd._files) > 0
    assert len(reader.ssd._files) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["inspect", "{store}", "--json", "/nonexistent/x.json"],
            "its directory '/nonexistent' does not exist",
        ),
        (["inspect", "{store}", "--json", "{store}"], "is a directory"),
        (["demo", "--examples", "-5"], "examples: expected an int >= 1. Got -5 instead."),
        (["demo", "--batch-size", "0"], "batch_size: expected an int >= 1. Got 0 instead."),
        (["demo", "--pass-batches", "0"], "pass_batches: expected an int >= 1"),
        (["demo", "--max-rows", "0"], "max_rows: expected an int >= 1 or null"),
        (["demo", "--examples", "5", "--no-progress"], "an AUC needs both clicks and non-clicks"),
        (["demo", "--data", "/nonexistent/day_0"], "data: no file or directory"),
        (["demo", "--json", "/nonexistent/x.json"], "its directory '/nonexistent' does not exist"),
    ],
)
def test_the_command_line_says_what_is_wrong_in_one_line(trained, capsys, argv, message):
    from hierps.cli import main

    store, _ = trained
    path = str(store.path)
    store.close()  # inspect reads it from outside
    assert main([a.format(store=path) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert out == ""  # refused before any work


def test_batch_ids_index_dicts_and_tuples_only(trained):
    """``{"user": 5}`` on a batch that is a tensor read its sixth row as ids; it is refused, and a
    module name the engine does not train is refused when the loader is made."""
    from types import SimpleNamespace

    from hierps.integrations.loader import PassLoader

    store, bag = trained
    batches = [torch.arange(8 * i, 8 * i + 8).reshape(8, 1) for i in range(3)]
    with pytest.raises(
        errors.ConfigError, match=r"reads batch\[5\], which this batch does not have \(a Tensor\)"
    ):
        list(PassLoader(batches, {"t": 5}, store, pass_batches=2))
    assert store.passes == 0
    engine = SimpleNamespace(hierps_store=store, hierps_modules={"t": bag}, hierps_config=None)
    with pytest.raises(errors.ConfigError, match=r"batch_ids: 'user' is not a module the store trains"):
        PassLoader(batches, {"user": 0}, engine)
    loader = PassLoader([(b, b) for b in batches], {"t": 0}, engine, pass_batches=2)
    assert [int(x.sum()) for x, _ in loader] == [int(b.sum()) for b in batches] and store.passes == 2
