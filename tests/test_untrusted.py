"""Nothing hierps loads runs code: crafted stores are refused with a clear error, and the pickle
payloads planted in them (which would create a marker file when unpickled) never run.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import hierps
from hierps._store import store_parts
from hierps.errors import CorruptStoreError, StoreFormatError
from hierps.storage import FORMAT_VERSION
from hierps.storage._files import read_json_checked, write_json_atomic
from hierps.tiers._reader import CheckpointReader

ROOT = Path(__file__).resolve().parent.parent
KEYS = np.arange(50, dtype=np.int64)


def _pickle_payload(marker: Path) -> bytes:
    """Pickle opcodes (written by hand) calling ``open(marker, "w")`` when unpickled."""
    return b"cbuiltins\nopen\n(V" + str(marker).encode() + b"\nVw\ntR."


@pytest.fixture
def store_path(tmp_path) -> Path:
    path = tmp_path / "store"
    with hierps.Store(path, memory_budget="1KiB", device="cpu") as store:
        bag = hierps.EmbeddingBag(None, 4, mode="sum", store=store, name="t")
        with store.run_pass({"t": KEYS}):
            bag(torch.from_numpy(KEYS), torch.arange(0, 50, 5)).sum().backward()
            store.step()
        store.checkpoint()
    return path


def _a_segment(path: Path) -> Path:
    with hierps.Store(path, device="cpu") as store:
        return path / "segments" / "t" / f"{store_parts(store).core.ssd.segments('t')[0][1]:08d}"


def _plant(array_dir: Path, marker: Path, edit) -> None:
    """Rewrite the array's zarr.json with ``edit`` and put a pickle payload in every chunk."""
    meta = json.loads((array_dir / "zarr.json").read_text())
    edit(meta)
    (array_dir / "zarr.json").write_text(json.dumps(meta))
    for chunk in (array_dir / "c").rglob("*"):
        if chunk.is_file():
            chunk.write_bytes(_pickle_payload(marker))


CRAFTED = {
    "numcodecs pickle codec": lambda m: m.update(codecs=[{"name": "numcodecs.pickle", "configuration": {}}]),
    "pickle after bytes": lambda m: m.update(codecs=[*m["codecs"][:1], {"name": "numcodecs.pickle"}]),
    "object dtype": lambda m: m.update(data_type="object"),
    "variable-length string dtype": lambda m: m.update(data_type="string"),
    "storage transformer": lambda m: m.update(storage_transformers=[{"name": "pickle"}]),
    "extra metadata key": lambda m: m.update(object_codec={"id": "pickle"}),
}


@pytest.mark.parametrize("kind", list(CRAFTED))
def test_crafted_segment_is_refused_and_runs_nothing(store_path, tmp_path, kind):
    marker = tmp_path / "pwned"
    rows = _a_segment(store_path) / "rows"
    _plant(rows, marker, CRAFTED[kind])
    with hierps.Store(store_path, device="cpu") as store:
        with pytest.raises(
            CorruptStoreError, match=re.escape(str(rows / "zarr.json")) + ": not an array hierps wrote"
        ):
            store.read_rows("t", KEYS)
    reader = CheckpointReader(store_path)
    with pytest.raises(CorruptStoreError, match="refuses others without decoding them"):
        reader.read("t", reader.keys("t"))
    assert not marker.exists()


def test_zarr_v2_array_with_pickle_compressor_is_refused(store_path, tmp_path):
    marker = tmp_path / "pwned"
    rows = _a_segment(store_path) / "rows"
    shutil.rmtree(rows)
    rows.mkdir()
    (rows / ".zarray").write_text(
        json.dumps(
            {
                "zarr_format": 2,
                "shape": [50, 8],
                "chunks": [50, 8],
                "dtype": "<f4",
                "compressor": {"id": "pickle"},
                "fill_value": 0.0,
                "filters": None,
                "order": "C",
            }
        )
    )
    (rows / "0.0").write_bytes(_pickle_payload(marker))
    with hierps.Store(store_path, device="cpu") as store:
        with pytest.raises(CorruptStoreError, match="Zarr v2 array, which hierps never writes"):
            store.read_rows("t", KEYS)
    assert not marker.exists()


@pytest.mark.parametrize("array", ["fences", "filter"])
def test_crafted_segment_index_arrays_are_refused(store_path, tmp_path, array):
    """A segment's fences and filter (what finds its keys) are checked like its rows."""
    marker = tmp_path / "pwned"
    crafted = _a_segment(store_path) / array
    _plant(crafted, marker, CRAFTED["numcodecs pickle codec"])
    with (
        hierps.Store(store_path, device="cpu") as store,
        pytest.raises(CorruptStoreError, match=re.escape(str(crafted / "zarr.json"))),
    ):
        store.read_rows("t", KEYS)
    reader = CheckpointReader(store_path)
    with pytest.raises(CorruptStoreError, match="not an array hierps wrote"):
        reader.read("t", KEYS)
    assert not marker.exists()


def _edit_manifest(path: Path, edit) -> None:
    """Change the latest manifest with ``edit`` and store it with a valid checksum (as an attacker could)."""
    manifest = path / "checkpoints" / "00000001.json"
    body = read_json_checked(manifest)
    edit(body)
    write_json_atomic(manifest, body)


MANIFESTS = {
    "dim as a string": (
        lambda b: b["tables"]["t"].update(dim="4"),
        r"tables.t.dim: expected an int >= 1. Got '4'",
    ),
    "tables as a list": (lambda b: b.update(tables=["t"]), r"tables: expected an object of tables"),
    "seed as a float": (lambda b: b.update(seed=1.5), r"seed: expected an int. Got 1.5"),
    "step as a bool": (lambda b: b["tables"]["t"].update(step=True), r"tables.t.step: expected an int >= 0"),
    "segments as a list": (
        lambda b: b["tables"]["t"].update(segments=[1, 2]),
        r"tables.t.segments: expected",
    ),
    "segment id not a number": (
        lambda b: b["tables"]["t"]["segments"].update({"../../x": 1}),
        r"tables.t.segments",
    ),
    "table name escaping the store": (
        lambda b: b["tables"].update({"../../etc": b["tables"]["t"]}),
        r"table name '../../etc' is not a valid table name",
    ),
    "optimizer as code": (
        lambda b: b["tables"]["t"].update(optimizer={"type": "__import__('os').system('x')"}),
        r"table 't': optimizer.type: unknown sparse optimizer",
    ),
    "initializer as a list": (
        lambda b: b["tables"]["t"].update(initializer=["normal"]),
        r"table 't': initializer",
    ),
    "id of another checkpoint": (lambda b: b.update(id=7), r"field id: expected the checkpoint id 1"),
    "segments without live counts": (
        lambda b: b["tables"]["t"].update(segments={"99": 1}),
        r"tables.t.live: expected an object of segment id -> live rows, for the same segments",
    ),
}


@pytest.mark.parametrize("kind", list(MANIFESTS))
def test_manifest_with_unexpected_content_is_refused(store_path, kind):
    edit, message = MANIFESTS[kind]
    _edit_manifest(store_path, edit)
    with pytest.raises(CorruptStoreError, match=re.escape(str(store_path / "checkpoints")) + ".*" + message):
        hierps.Store(store_path, device="cpu")
    with pytest.raises(CorruptStoreError, match=message):
        CheckpointReader(store_path)


def test_manifest_of_another_format_version(store_path):
    _edit_manifest(store_path, lambda b: b.update(format_version=99))
    with pytest.raises(
        StoreFormatError, match=f"checkpoint 1 has format version 99; this hierps reads {FORMAT_VERSION}"
    ):
        hierps.Store(store_path, device="cpu")
    with pytest.raises(StoreFormatError, match="format version 99"):
        CheckpointReader(store_path)


def test_marker_with_unexpected_content(store_path):
    write_json_atomic(store_path / "hierps.json", {"format": "hierps-store", "format_version": "1"})
    with pytest.raises(StoreFormatError, match="written by store format version '1'"):
        hierps.Store(store_path, device="cpu")
    with pytest.raises(StoreFormatError, match="written by store format version '1'"):
        CheckpointReader(store_path)
    doc = {"crc32": 0, "body": ["a", "list"]}
    doc["crc32"] = zlib.crc32(json.dumps(doc["body"], sort_keys=True, indent=1).encode())
    (store_path / "hierps.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptStoreError, match="expected a JSON object as body. Got list"):
        hierps.Store(store_path, device="cpu")


# Calls that can run code from data: unpickling (also via numpy / torch), marshal, eval / exec, yaml.
_FORBIDDEN = [
    (
        re.compile(r"^\s*(import|from)\s+(pickle|cPickle|dill|cloudpickle|marshal|shelve|joblib)\b", re.M),
        "imports",
    ),
    (re.compile(r"\bpickle\.loads?\b|\bmarshal\.loads?\b"), "unpickles"),
    (re.compile(r"allow_pickle\s*=\s*True"), "lets numpy unpickle"),
    (
        re.compile(r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)"),
        "calls torch.load without weights_only=True",
    ),
    (re.compile(r"(?<![\w.])(eval|exec)\s*\("), "calls eval/exec"),
    (re.compile(r"\byaml\.(load|unsafe_load)\("), "loads yaml unsafely"),
    (re.compile(r"\bnumcodecs\.(Pickle|pickles)\b"), "uses the numcodecs pickle codec"),
]


def test_no_code_that_unpickles_or_evaluates_data():
    offences = []
    for source in sorted([*(ROOT / "plugin").rglob("*.py"), *(ROOT / "integrations").rglob("*.py")]):
        text = source.read_text(encoding="utf-8")
        for pattern, what in _FORBIDDEN:
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                offences.append(f"{source.relative_to(ROOT)}:{line} {what}: {m.group(0).strip()}")
    assert not offences, "\n".join(offences)
