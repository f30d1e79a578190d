"""Which exports serving applies: a delta only to the rows it was taken since (not to another store's
rows of the same checkpoint number, nor to a checkpoint rolled back), a gap in a serving directory
reported, and the settings and paths of serving and exporting checked at the call.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import hierps
from hierps import serving
from hierps.errors import ConfigError, StoreFormatError
from hierps.lifecycle._export import export_store
from hierps.serving import _tables
from hierps.storage._commit_log import rank_dir, write_record
from hierps.storage._export_format import CheckpointRef, read_manifest
from hierps.storage._marker import check_marker

KEYS = np.arange(0, 40, dtype=np.int64)
PROBE = np.concatenate([KEYS, [10**6, -3]])  # and two keys no export holds


def _store(path: Path) -> hierps.Store:
    store = hierps.Store(path, device="cpu", keep_checkpoints=8)
    store.table("t", 4)
    return store


def _checkpoint(store: hierps.Store, keys: np.ndarray, value: float) -> int:
    store.write("t", keys, np.full((len(keys), 4), value, np.float32))
    return store.checkpoint()


def _rows(store: hierps.Store) -> np.ndarray:
    return store.lookup("t", torch.from_numpy(PROBE)).numpy().copy()


def _uid(store_dir: Path) -> str:
    return check_marker(store_dir / "hierps.json").uid


def _served(tables: serving.ServingTables) -> np.ndarray:
    return np.asarray(tables.lookup("t", PROBE))


@pytest.fixture
def recreated(tmp_path: Path) -> dict:
    """A store A exported in full at checkpoint 2 into a serving directory; then A is deleted and
    created again as B (a retrain from scratch) at the same path, which exports a delta since its
    own checkpoint 2 into the same directory."""
    path, serve = tmp_path / "store", tmp_path / "serve"
    with _store(path) as a:
        _checkpoint(a, KEYS, 1.0)
        assert _checkpoint(a, KEYS[:10], 2.0) == 2
        a.export(serve / "a-full")
        rows_a, uid_a = _rows(a), _uid(path)
    shutil.rmtree(path)
    b = _store(path)
    for value in (5.0, 6.0):
        _checkpoint(b, KEYS[20:], value)
    c3 = _checkpoint(b, KEYS[30:], 7.0)
    yield {"serve": serve, "b": b, "rows_a": rows_a, "uid_a": uid_a, "uid_b": _uid(path), "c3": c3}
    b.close()


def _foreign(info: dict) -> str:
    """The refusal of B's delta over A's rows: it names both stores, and says to export in full."""
    return (
        rf"is a delta that applies to the rows of checkpoint 2 of store {info['uid_b']} \(taken [^)]*\), "
        rf"but the rows so far \({re.escape(str(info['serve'] / 'a-full'))}\) are those of checkpoint 2 of "
        rf"store {info['uid_a']} \(taken [^)]*\): they are another store's .* full export of checkpoint "
        rf"{info['c3']} of the delta's store"
    )


def test_a_delta_of_a_store_created_again_is_refused_given_explicitly(recreated):
    info = recreated
    delta = info["serve"] / "b-delta"
    info["b"].export(delta, since=2)
    with pytest.raises(ConfigError, match=re.escape(str(delta)) + ": " + _foreign(info)):
        serving.open(info["serve"] / "a-full", deltas=[delta])
    with serving.open(info["serve"] / "a-full") as tables:
        with pytest.raises(ConfigError, match=_foreign(info)):
            tables.refresh([delta])
        assert tables.generation == 1
        np.testing.assert_array_equal(_served(tables), info["rows_a"])


def test_a_delta_of_a_store_created_again_is_refused_in_a_serving_directory(recreated, caplog):
    info = recreated
    caplog.set_level(logging.WARNING, logger="hierps.serving")
    with serving.open(info["serve"], follow=0.01) as tables:
        info["b"].export(info["serve"] / "b-delta", since=2)
        assert tables.wait_for_poll(timeout=600)
        assert isinstance(tables.refresh_error, ConfigError)
        assert re.search(_foreign(info), str(tables.refresh_error))
        with pytest.raises(ConfigError, match=_foreign(info)):
            tables.refresh()
        with pytest.raises(ConfigError, match=_foreign(info)):
            serving.open(info["serve"])
        assert tables.generation == 1
        np.testing.assert_array_equal(_served(tables), info["rows_a"])
        # What the error says to do: B exported in full (at checkpoint 3, A's export was at 2) is
        # served, being of the checkpoint taken last; B's delta is then history.
        info["b"].export(info["serve"] / "b-full")
        assert tables.wait_for_poll(timeout=600)
        assert tables.refresh_error is None and tables.generation == 2
        assert [p.name for p in tables.applied] == ["b-full"]
        np.testing.assert_array_equal(_served(tables), _rows(info["b"]))
    warned = [r for r in caplog.records if "another store's" in r.getMessage()]
    assert len(warned) == 1  # however many polls found it


def test_the_base_of_a_store_created_again_is_served_though_its_checkpoint_id_is_lower(tmp_path):
    path, serve = tmp_path / "store", tmp_path / "serve"
    with _store(path) as a:
        for value in (1.0, 2.0, 3.0):
            _checkpoint(a, KEYS, value)
        a.export(serve / "a-full")  # checkpoint 3
    shutil.rmtree(path)
    with _store(path) as b:
        _checkpoint(b, KEYS[5:], 9.0)
        b.export(serve / "b-full")  # checkpoint 1 of another store, taken later
        with serving.open(serve) as tables:
            assert [p.name for p in tables.applied] == ["b-full"] and tables.checkpoint == 1
            np.testing.assert_array_equal(_served(tables), _rows(b))


def test_a_delta_since_a_checkpoint_rolled_back_is_refused(tmp_path):
    """Checkpoint ids are reused after a rollback: a delta since the new checkpoint 3 does not apply
    to an export of the old one."""
    serve = tmp_path / "serve"
    with _store(tmp_path / "store") as store:
        for value in (1.0, 2.0, 3.0):
            _checkpoint(store, KEYS, value)
        store.export(serve / "full3")
        old = _rows(store)
        store.rollback(2)
        assert _checkpoint(store, KEYS[:5], 8.0) == 3
        assert _checkpoint(store, KEYS[5:9], 9.0) == 4
        store.export(serve / "delta34", since=3)
        new = _rows(store)
    rolled_back = r"the store was rolled back and checkpointed again in between"
    with pytest.raises(
        ConfigError, match=re.escape(str(serve / "delta34")) + ": is a delta .*" + rolled_back
    ):
        serving.open(serve / "full3", deltas=[serve / "delta34"])
    with pytest.raises(ConfigError, match=rolled_back):
        serving.open(serve)
    with serving.open(serve / "full3") as tables:
        with pytest.raises(ConfigError, match=rolled_back):
            tables.refresh([serve / "delta34"])
        np.testing.assert_array_equal(_served(tables), old)
    assert not np.array_equal(old, new)


def test_a_gap_in_a_serving_directory_is_reported(tmp_path, caplog):
    """Base c1 and delta c2 -> c3 served, c1 -> c2 missing: refresh (and so follow) says which delta
    is missing, a warning is logged once, and once the delta is there the chain is served."""
    caplog.set_level(logging.WARNING, logger="hierps.serving")
    serve, aside = tmp_path / "serve", tmp_path / "aside"
    with _store(tmp_path / "store") as store:
        _checkpoint(store, KEYS, 1.0)
        store.export(serve / "full1")
        base = _rows(store)
        with serving.open(serve, follow=0.01) as tables:
            _checkpoint(store, KEYS[:20], 2.0)
            store.export(aside / "d12", since=1)
            _checkpoint(store, KEYS[10:30], 3.0)
            store.export(serve / "d23", since=2)
            missing = (
                rf"{re.escape(str(serve))}: the chain of exports ends at checkpoint 1 "
                rf"\({re.escape(str(serve / 'full1'))}\), but {re.escape(str(serve / 'd23'))} is a delta "
                r"from checkpoint 2 to 3 of the same store: the delta from checkpoint 1 to checkpoint 2 is "
                r"missing\. Export it into this directory \(hierps export STORE OUT --since 1 --checkpoint 2\)"
            )
            for _ in range(3):
                assert tables.wait_for_poll(timeout=600)
                assert isinstance(tables.refresh_error, ConfigError)
                assert re.match(missing, str(tables.refresh_error)), tables.refresh_error
                assert tables.generation == 1
            with pytest.raises(ConfigError, match=missing):
                tables.refresh()
            with pytest.raises(ConfigError, match=missing):
                serving.open(serve)
            np.testing.assert_array_equal(_served(tables), base)
            shutil.copytree(aside / "d12", serve / "d12")
            assert tables.wait_for_poll(timeout=600)
            assert tables.refresh_error is None and tables.generation == 2 and tables.checkpoint == 3
            assert [p.name for p in tables.applied] == ["full1", "d12", "d23"]
            np.testing.assert_array_equal(_served(tables), _rows(store))
    warned = [r for r in caplog.records if "is missing" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING


def test_the_chain_reaching_the_latest_checkpoint_is_served(tmp_path):
    """Deltas c1 -> c3 and c1 -> c2 -> c4: the chain that reaches checkpoint 4 is served."""
    serve = tmp_path / "serve"
    with _store(tmp_path / "store") as store:
        _checkpoint(store, KEYS, 1.0)
        store.export(serve / "a-full1")
        _checkpoint(store, KEYS[:10], 2.0)
        store.export(serve / "c-d12", since=1)
        _checkpoint(store, KEYS[10:20], 3.0)
        store.export(serve / "b-d13", since=1)
        _checkpoint(store, KEYS[20:30], 4.0)
        store.export(serve / "d-d24", since=2)
        with serving.open(serve) as tables:
            assert [p.name for p in tables.applied] == ["a-full1", "c-d12", "d-d24"]
            np.testing.assert_array_equal(_served(tables), _rows(store))


def test_exports_of_format_version_3_are_refused(tmp_path):
    with _store(tmp_path / "store") as store:
        _checkpoint(store, KEYS, 1.0)
        store.export(tmp_path / "full")
    manifest = tmp_path / "full" / "manifest.json"
    body = json.loads(manifest.read_text())
    del body["crc32"], body["store"], body["checkpoint_created"], body["since_created"]
    body["format_version"] = 3
    body["crc32"] = zlib.crc32(json.dumps(body, sort_keys=True, indent=1).encode("utf-8"))
    manifest.write_text(json.dumps(body))
    with pytest.raises(
        StoreFormatError,
        match=re.escape(str(manifest))
        + r": an export of format version 3; this hierps serves version 4\. Version 3 .* did not record "
        r"which store .* Export the checkpoint again",
    ):
        serving.open(tmp_path / "full")


def test_an_export_names_the_store_and_checkpoints_it_was_taken_from(tmp_path):
    with _store(tmp_path / "store") as store:
        _checkpoint(store, KEYS, 1.0)
        _checkpoint(store, KEYS[:3], 2.0)
        created = {c["id"]: c["created"] for c in store.list_checkpoints()}
        full = store.export(tmp_path / "full")
        delta = store.export(tmp_path / "delta", since=1)
    uid = _uid(tmp_path / "store")
    assert (full["store"], full["checkpoint_created"], full["since_created"]) == (uid, created[2], None)
    assert (delta["store"], delta["checkpoint_created"], delta["since_created"]) == (
        uid,
        created[2],
        created[1],
    )
    assert read_manifest(tmp_path / "delta").applies_to == CheckpointRef(uid, 1, created[1], 1)
    assert read_manifest(tmp_path / "full").state == read_manifest(tmp_path / "delta").state
    assert read_manifest(tmp_path / "full").applies_to is None


def test_a_directory_of_rank_stores_exports_under_rank_0s_identity(tmp_path):
    root = tmp_path / "job"
    parts = []
    for rank in range(2):
        with _store(rank_dir(root, rank)) as store:
            store.write("t", KEYS[rank::2], np.full((20, 4), rank, np.float32))
            parts.append(store.checkpoint(extra={"world_size": 2, "rank": rank}))
    write_record(root, parts, None)
    manifest = export_store(root, tmp_path / "exp")
    assert manifest["store"] == _uid(rank_dir(root, 0)) and manifest["ranks"] == 2
    with pytest.raises(ConfigError, match="is inside the store directory"):
        export_store(root, root / "exports" / "x")
    with pytest.raises(ConfigError, match="is inside the store directory"):
        export_store(root, rank_dir(root, 1) / "segments" / "x")
    assert not (root / "exports").exists() and not (rank_dir(root, 1) / "segments" / "x").exists()


def test_the_follower_survives_an_unexpected_error(tmp_path, monkeypatch, caplog):
    """A refresh that fails with an error that is not hierps' (a bug) is kept and logged once with
    its traceback; the follow thread polls on, and the next export is served."""
    caplog.set_level(logging.WARNING, logger="hierps.serving")
    serve = tmp_path / "serve"
    with _store(tmp_path / "store") as store:
        _checkpoint(store, KEYS, 1.0)
        store.export(serve / "full1")
        with serving.open(serve, follow=0.01) as tables:

            def broken(root: Path) -> None:
                raise RuntimeError("not hierps")

            monkeypatch.setattr(_tables, "find_chain", broken)
            for _ in range(2):
                assert tables.wait_for_poll(timeout=600)
                assert isinstance(tables.refresh_error, RuntimeError)
            monkeypatch.undo()
            _checkpoint(store, KEYS[:5], 2.0)
            store.export(serve / "d12", since=1)
            assert tables.wait_for_poll(timeout=600)
            assert tables.refresh_error is None and tables.checkpoint == 2
            np.testing.assert_array_equal(_served(tables), _rows(store))
    logged = [r for r in caplog.records if "not hierps" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR and logged[0].exc_info is not None


# -- settings and paths, checked at the call ---------------------------------------------------------
@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    with _store(tmp_path / "store") as store:
        _checkpoint(store, KEYS, 1.0)
        store.export(tmp_path / "serve" / "full")
    return tmp_path / "serve"


@pytest.mark.parametrize("follow", ["x", True, math.inf, 1e300, -1, 0, math.nan, [30]])
def test_follow_must_be_a_number_of_seconds(export_dir, follow):
    expected = rf"follow: expected a number of seconds in \(0, 9\.22337e\+09\], e\.g\. follow=30 \(or None not to follow\)\. Got {re.escape(repr(follow))} instead\."
    with pytest.raises(ConfigError, match=expected):
        serving.open(export_dir, follow=follow)
    with serving.open(export_dir) as tables:
        with pytest.raises(ConfigError, match=expected):
            tables.follow(follow)
        with pytest.raises(ConfigError, match="wait_for_poll: these tables are not following"):
            tables.wait_for_poll()
    with serving.open(export_dir, follow=np.float64(600)) as tables:
        with pytest.raises(ConfigError, match=r"timeout: expected a number of seconds"):
            tables.wait_for_poll(timeout=follow)


@pytest.mark.parametrize("where", ["base", "delta", "refresh"])
def test_serving_paths_with_a_nul_byte_are_refused(export_dir, where):
    bad = str(export_dir / "full") + "\0x"
    with pytest.raises(ConfigError, match=r"expected the path of an export .*NUL.* Got '.*\\x00x' instead"):
        if where == "base":
            serving.open(bad)
        elif where == "delta":
            serving.open(export_dir / "full", deltas=[bad])
        else:
            serving.open(export_dir / "full").refresh([bad])
    with pytest.raises(ConfigError, match="deltas: expected a list of export paths"):
        serving.open(export_dir / "full", deltas=str(export_dir / "full"))


def test_export_paths_are_checked(tmp_path):
    path = tmp_path / "store"
    with _store(path) as store:
        _checkpoint(store, KEYS, 1.0)
        before = sorted(p.relative_to(path) for p in path.rglob("*"))
        with pytest.raises(
            ConfigError, match=r"export path '.*/out\\x00x': not a valid path \(it holds a NUL byte\)"
        ):
            store.export(str(tmp_path / "out") + "\0x")
        for inside in (path / "segments" / "exp", path / "exp", path / "checkpoints" / "a" / "b"):
            with pytest.raises(
                ConfigError,
                match=rf"export path '{re.escape(str(inside))}': is inside the store directory "
                rf"'{re.escape(str(path.resolve()))}'.*export to a directory outside the store",
            ):
                store.export(inside)
        assert sorted(p.relative_to(path) for p in path.rglob("*")) == before
        with pytest.raises(ConfigError, match="store path '.*\\\\x00': not a valid path"):
            export_store(str(path) + "\0", tmp_path / "out")
        store.export(tmp_path / "out")  # and beside it, it exports
    with serving.open(tmp_path / "out") as tables:
        np.testing.assert_array_equal(tables.lookup("t", KEYS), 1.0)
