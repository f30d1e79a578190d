"""The life of a feature: admission, counters, eviction, delta export, serving and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import hierps
from hierps import serving
from hierps._store import store_parts
from hierps.cli import main
from hierps.config import AdmissionConfig, EvictionConfig
from hierps.errors import ConfigError
from hierps.rows._initializers import initial_rows

DIM = 4
SGD = {"type": "sgd", "params": {"lr": 0.1}}
ADAGRAD = {"type": "adagrad", "params": {"lr": 0.2}}


def _target(ids: torch.Tensor) -> torch.Tensor:
    """A fixed target row per key: each key's gradient depends on its own row only."""
    return torch.sin(ids.to(torch.float32)[:, None] * torch.arange(1, DIM + 1, dtype=torch.float32) * 0.37)


def _train_batch(store: hierps.Store, emb: hierps.Embedding, ids: torch.Tensor) -> None:
    loss = ((emb(ids) - _target(ids)) ** 2).sum()
    loss.backward()
    store.step()


def _batches(seed: int, n: int, size: int = 12, hot: int = 20, cold: int = 2000) -> list[torch.Tensor]:
    """Hot keys seen often, plus cold keys that show up a few times only."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = np.where(
            rng.random(size) < 0.6, rng.integers(0, hot, size), rng.integers(hot, hot + cold, size)
        )
        out.append(torch.from_numpy(ids.astype(np.int64)))
    return out


def _tiers(store: hierps.Store, table: str, keys: np.ndarray) -> np.ndarray:
    """(n,) bool: the key has a row in the device, RAM or SSD tier."""
    keys = np.asarray(keys, np.int64)
    dev, _ = store_parts(store).core.device_tier.resolve(table, torch.from_numpy(keys))
    return (
        dev.numpy()
        | store_parts(store).core.memory.contains(table, keys)
        | store_parts(store).core.ssd.contains(table, keys)
    )


def segment_keys(seg: Path) -> np.ndarray:
    """The keys of a segment read with plain zarr: its rows' first two float32 columns hold them."""
    rows = zarr.open_array(str(seg / "rows"), mode="r")[:]
    return np.ascontiguousarray(rows[:, :2]).view(np.int64).reshape(-1)


def _keys_on_disk(store_path: Path, table: str) -> np.ndarray:
    """Keys of every segment file of ``table`` left on disk, read with plain zarr."""
    found = [segment_keys(seg) for seg in (store_path / "segments" / table).iterdir() if seg.name.isdigit()]
    return np.concatenate(found) if found else np.empty(0, np.int64)


def _sightings(batches: list[torch.Tensor]) -> dict[int, int]:
    keys, counts = np.unique(torch.cat(batches).numpy(), return_counts=True)
    return dict(zip(keys.tolist(), counts.tolist()))


# -- admission --------------------------------------------------------------------------------
def test_keys_seen_fewer_than_min_count_never_get_a_row(make_store):
    store = make_store(memory_budget="1KiB", optimizer=ADAGRAD, keep_checkpoints=1)
    emb = hierps.Embedding(None, DIM, store=store, name="t", admission={"min_count": 3})
    batches = _batches(0, 24)
    for start in range(0, 24, 4):
        group = batches[start : start + 4]
        with store.run_pass([{"t": b} for b in group]):
            for ids in group:
                _train_batch(store, emb, ids)
        store.checkpoint()
    seen = _sightings(batches)
    rare = np.array([k for k, n in seen.items() if n < 3])
    often = np.array([k for k, n in seen.items() if n >= 3])
    assert len(rare) > 50 and len(often) > 10
    assert not _tiers(store, "t", rare).any()
    assert _tiers(store, "t", often).all()
    assert not np.isin(rare, _keys_on_disk(store.path, "t")).any()
    # Rare keys are pending, with their exact counts; they read as their initial rows.
    pending = store_parts(store).core.pending_keys["t"]
    np.testing.assert_array_equal(pending.count_of(rare), [seen[k] for k in rare.tolist()])
    info = store.tables["t"]
    np.testing.assert_array_equal(
        store.lookup("t", torch.from_numpy(rare)).numpy(),
        initial_rows(rare, DIM, info.salt, info.initializer),
    )
    # An admitted row's count includes the sightings before its admission.
    np.testing.assert_array_equal(store.counters("t", often)["count"], [seen[k] for k in often.tolist()])


@pytest.mark.parametrize("opt", [ADAGRAD, {"type": "adam", "params": {"lr": 0.05}}])
def test_admitted_row_trains_like_an_unfiltered_row_from_admission_on(make_store, opt):
    filtered = make_store("filtered", memory_budget="1KiB", optimizer=opt)
    plain = make_store("plain", memory_budget="1KiB", optimizer=opt)
    emb_f = hierps.Embedding(None, DIM, store=filtered, name="t", admission={"min_count": 3})
    emb_p = hierps.Embedding(None, DIM, store=plain, name="t")
    info = filtered.tables["t"]
    admitted_all = []
    batches = _batches(1, 20, cold=60)
    for start in range(0, 20, 5):
        group = batches[start : start + 5]
        with filtered.run_pass([{"t": b} for b in group]), plain.run_pass([{"t": b} for b in group]):
            for ids in group:
                keys = torch.unique(ids).numpy()
                before = filtered.has_rows("t", keys)
                _train_batch(filtered, emb_f, ids)
                new = keys[~before & filtered.has_rows("t", keys)]
                admitted_all.append(new)
                # The reference: the unfiltered row of each newly admitted key reset to where the
                # filtered one starts (its initial row, fresh optimizer state) before this batch.
                if len(new):
                    plain.write("t", new, initial_rows(new, DIM, info.salt, info.initializer))
                _train_batch(plain, emb_p, ids)
    admitted = np.concatenate(admitted_all)
    assert len(admitted) > 20
    np.testing.assert_array_equal(filtered.read_rows("t", admitted), plain.read_rows("t", admitted))


def test_pending_keys_are_bounded_and_survive_a_checkpoint(make_store, tmp_path):
    store = make_store(optimizer=SGD)
    emb = hierps.Embedding(
        None, DIM, store=store, name="t", admission={"min_count": 5, "max_pending": 8, "unadmitted": "zeros"}
    )
    for p in range(3):
        with store.run_pass({"t": torch.arange(10 * p, 10 * p + 10)}):
            _train_batch(store, emb, torch.arange(10 * p, 10 * p + 10))
    assert store.num_pending("t") <= 8
    assert store_parts(store).core.pending_keys["t"].forgotten > 0
    # The most recently seen keys are the ones kept.
    assert set(store_parts(store).core.pending_keys["t"].keys.tolist()) <= set(range(20, 30))
    assert not store.has_rows("t", np.arange(30)).any()
    # Pending keys read as zeros, in lookups and forward passes alike.
    assert torch.count_nonzero(store.lookup("t", torch.arange(30))) == 0
    emb.eval()
    assert torch.count_nonzero(emb(torch.arange(30))) == 0
    before = store_parts(store).core.pending_keys["t"].arrays()
    store.checkpoint()
    store.close()
    reopened = make_store(optimizer=SGD)
    after = store_parts(reopened).core.pending_keys["t"].arrays()
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])
    assert reopened.tables["t"].admission == AdmissionConfig(min_count=5, max_pending=8, unadmitted="zeros")


def test_probability_admission_is_deterministic_per_key(make_store):
    admitted = []
    for name in ("a", "b"):
        store = make_store(name, optimizer=SGD, seed=3)
        emb = hierps.Embedding(
            None, DIM, store=store, name="t", admission={"min_count": None, "admit_probability": 0.3}
        )
        ids = torch.arange(0, 400)
        _train_batch(store, emb, ids)
        admitted.append(store.has_rows("t", ids.numpy()))
    np.testing.assert_array_equal(admitted[0], admitted[1])
    assert 0.2 < admitted[0].mean() < 0.4


# -- counters ---------------------------------------------------------------------------------
def test_counters_travel_through_tiers_and_checkpoints(make_store):
    store = make_store(memory_budget="1KiB", optimizer=ADAGRAD)
    bag = hierps.EmbeddingBag(None, DIM, mode="sum", store=store, name="t")
    ids, offsets, labels = torch.tensor([1, 2, 2, 3, 1, 4]), torch.tensor([0, 3]), torch.tensor([1.0, 0.0])
    for _ in range(3):
        with store.run_pass({"t": ids}):
            bag(ids, offsets).sum().backward()
            store.step()
            bag.observe(ids, offsets, labels)
    expect = {"count": [6, 6, 3, 3], "show": [6, 6, 3, 3], "click": [3, 6, 0, 0], "last_pass": [2, 2, 2, 2]}
    got = store.counters("t", [1, 2, 3, 4])
    for name, values in expect.items():
        np.testing.assert_array_equal(got[name], values, err_msg=name)
    store.checkpoint()
    store.close()
    reopened = make_store(memory_budget="1KiB", optimizer=ADAGRAD)
    again = reopened.counters("t", [1, 2, 3, 4])
    for name in got:
        np.testing.assert_array_equal(again[name], got[name])


# -- eviction ---------------------------------------------------------------------------------
def test_shrink_deletes_rows_from_every_tier_and_from_disk(make_store):
    store = make_store(memory_budget="2KiB", optimizer=ADAGRAD, keep_checkpoints=1)
    emb = hierps.Embedding(None, DIM, store=store, name="t")
    old, kept = torch.arange(100, 160), torch.arange(0, 40)
    with store.run_pass({"t": torch.cat([old, kept])}):
        _train_batch(store, emb, torch.cat([old, kept]))
    for _ in range(3):
        with store.run_pass({"t": kept}):
            _train_batch(store, emb, kept)
    # Leave a few rows in the working set and in RAM too: shrink must reach every tier.
    store.begin_pass({"t": torch.cat([old[:5], kept[:5]])})
    store.checkpoint()
    assert np.isin(old.numpy(), _keys_on_disk(store.path, "t")).all()
    rows_before = store.read_rows("t", kept.numpy())
    counters_before = store.counters("t", kept.numpy())
    deleted = store.shrink(ttl_passes=2)
    assert deleted == {"t": len(old)}
    assert not _tiers(store, "t", old.numpy()).any()
    assert _tiers(store, "t", kept.numpy()).all()
    np.testing.assert_array_equal(store.read_rows("t", kept.numpy()), rows_before)
    for name, values in counters_before.items():
        np.testing.assert_array_equal(store.counters("t", kept.numpy())[name], values)
    # Deleted keys read as new keys again.
    info = store.tables["t"]
    np.testing.assert_array_equal(
        store.lookup("t", old).numpy(), initial_rows(old.numpy(), DIM, info.salt, info.initializer)
    )
    # Once the older checkpoint is retired, no file on disk holds the deleted rows.
    store.checkpoint()
    on_disk = _keys_on_disk(store.path, "t")
    assert not np.isin(old.numpy(), on_disk).any()
    assert np.isin(kept.numpy(), on_disk).all()


@pytest.mark.parametrize("reclaim", [True, False])
def test_deleted_rows_leave_the_disk_at_once(make_store, reclaim):
    """Segments that held deleted rows are rewritten without them; ``reclaim_disk: false`` (hierps
    0.1's way to leave them to later compaction) is accepted with a warning and has no effect."""
    store = make_store(optimizer=SGD, keep_checkpoints=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        emb = hierps.Embedding(
            None, DIM, store=store, name="t", eviction={"min_decayed_count": 1.5, "reclaim_disk": reclaim}
        )
    assert any("reclaim_disk" in str(w.message) for w in caught) != reclaim
    once, twice = torch.arange(0, 10), torch.arange(10, 40)
    with store.run_pass({"t": torch.cat([once, twice, twice])}):
        _train_batch(store, emb, torch.cat([once, twice, twice]))
    store.checkpoint()  # one segment of 40 rows
    assert store.shrink() == {"t": 10}
    assert not store.has_rows("t", once.numpy()).any()
    store.checkpoint()
    # The segment was rewritten with its 30 live rows: the deleted ones left the disk.
    assert not np.isin(once.numpy(), _keys_on_disk(store.path, "t")).any()
    assert np.isin(twice.numpy(), _keys_on_disk(store.path, "t")).all()


def test_eviction_runs_at_pass_intervals_with_decayed_counts(make_store):
    store = make_store(optimizer=SGD)
    emb = hierps.Embedding(
        None, DIM, store=store, name="t", eviction={"min_decayed_count": 1.5, "decay": 0.5, "every_passes": 2}
    )
    hot, once = torch.arange(0, 5), torch.arange(50, 55)
    with store.run_pass({"t": torch.cat([hot, once, once])}):
        _train_batch(store, emb, torch.cat([hot, once, once]))  # once: decayed count 2
    assert store.has_rows("t", once.numpy()).all()
    with store.run_pass({"t": hot}):
        _train_batch(store, emb, hot)
    # After pass 2 (a shrink): once-keys were seen 2 times one pass ago -> 2 * 0.5 = 1 < 1.5.
    # Hot keys: 1 * 0.5 + 1 = 1.5, kept.
    assert not store.has_rows("t", once.numpy()).any()
    assert store.has_rows("t", hot.numpy()).all()
    np.testing.assert_allclose(store.counters("t", hot.numpy())["decayed"], 1.5)


def test_shrink_between_forward_and_step_is_refused(make_store):
    store = make_store(optimizer=SGD)
    emb = hierps.Embedding(None, DIM, store=store, name="t", eviction={"ttl_passes": 1})
    emb(torch.arange(4)).sum().backward()
    with pytest.raises(ConfigError, match="call store.step\\(\\) or store.zero_grad\\(\\) first"):
        store.shrink()


# -- export and serving -----------------------------------------------------------------------
def _export_series(store: hierps.Store, emb: hierps.Embedding, out: Path) -> list[int]:
    """Train in three stages with evictions; a full export and a delta after each stage.

    Stage 1 trains half of the hot keys only: the other half is unchanged in its delta.
    """
    ckpts = []
    for stage in range(3):
        for i, ids in enumerate(_batches(10 + stage, 6, hot=(30, 15, 30)[stage], cold=200)):
            with store.run_pass({"t": ids}):
                _train_batch(store, emb, ids)
            if i == 3:
                store.shrink(ttl_passes=6)
        ckpts.append(store.checkpoint(f"stage{stage}"))
        store.export(out / f"full{stage}")
        if stage:
            store.export(out / f"delta{stage}", since=ckpts[-2])
    return ckpts


def test_base_plus_deltas_equal_the_full_export(make_store, tmp_path):
    store = make_store(memory_budget="2KiB", optimizer=ADAGRAD, max_segments=3)
    emb = hierps.Embedding(None, DIM, store=store, name="t", admission={"min_count": 2})
    out = tmp_path / "exports"
    ckpts = _export_series(store, emb, out)
    d1 = json.loads((out / "delta1" / "manifest.json").read_text())
    assert d1["since"] == ckpts[0] and d1["checkpoint"] == ckpts[1]
    assert d1["tables"]["t"]["deleted"] > 0
    assert (
        0
        < d1["tables"]["t"]["rows"]
        < json.loads((out / "full1" / "manifest.json").read_text())["tables"]["t"]["rows"]
    )
    applied = serving.open(out / "full0", deltas=[out / "delta1", out / "delta2"])
    full = serving.open(out / "full2")
    assert applied.checkpoint == full.checkpoint == ckpts[2]
    np.testing.assert_array_equal(applied.keys("t"), full.keys("t"))
    np.testing.assert_array_equal(applied.lookup("t", full.keys("t")), full.lookup("t", full.keys("t")))
    # ... and both equal the store's rows, for stored and unknown keys alike.
    probe = torch.cat([torch.from_numpy(full.keys("t")), torch.arange(10_000, 10_010)])
    np.testing.assert_array_equal(full.lookup("t", probe.numpy()), store.lookup("t", probe).numpy())
    assert isinstance(full.lookup("t", probe), torch.Tensor)
    # A serving directory finds the newest base and its chain of deltas by itself.
    chained = serving.open(out)
    assert [p.name for p in chained.applied] == ["full2"]
    (out / "full2").rename(tmp_path / "elsewhere")
    chained = serving.open(out)
    assert [p.name for p in chained.applied] == ["full1", "delta2"]
    np.testing.assert_array_equal(chained.lookup("t", full.keys("t")), full.lookup("t", full.keys("t")))
    with pytest.raises(ConfigError, match="Pass deltas in order"):
        serving.open(out / "full0", deltas=[out / "delta2"])


def test_export_opens_with_plain_zarr(make_store, tmp_path):
    store = make_store(optimizer=ADAGRAD)
    emb = hierps.Embedding(None, DIM, store=store, name="user")
    hierps.Embedding(None, 2 * DIM, store=store, name="ad")
    _train_batch(store, emb, torch.arange(5))
    store.checkpoint()
    manifest = store.export(tmp_path / "exp")
    assert manifest["tables"]["user"] == {**manifest["tables"]["user"], "dim": DIM, "rows": 5}
    code = (
        "import json, sys, zarr\n"
        f"root = {str(tmp_path / 'exp')!r}\n"
        "m = json.load(open(root + '/manifest.json'))\n"
        "g = zarr.open_group(root, mode='r')\n"
        "out = {t: [m['tables'][t]['dim'], list(g[t]['keys'][:]), list(g[t]['values'].shape)] for t in m['tables']}\n"
        "assert 'hierps' not in sys.modules\n"
        "print(json.dumps(out, default=int))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=tmp_path
    )
    got = json.loads(proc.stdout)
    assert got == {"user": [DIM, [0, 1, 2, 3, 4], [5, DIM]], "ad": [2 * DIM, [], [0, 2 * DIM]]}
    values = zarr.open_group(str(tmp_path / "exp"), mode="r")["user"]["values"][:]
    np.testing.assert_array_equal(values, store.lookup("user", torch.arange(5)).numpy())


# -- CLI --------------------------------------------------------------------------------------
def test_cli_inspect_export_shrink(make_store, tmp_path, capsys):
    store = make_store(optimizer=ADAGRAD)
    emb = hierps.Embedding(None, DIM, store=store, name="t", admission={"min_count": 2})
    for p in range(3):
        with store.run_pass({"t": torch.arange(p, p + 6)}):
            _train_batch(store, emb, torch.arange(p, p + 6))
    first = store.checkpoint()
    path = store.path
    store.close()
    assert main(["inspect", str(path), "--json", str(tmp_path / "report.json")]) == 0
    text = capsys.readouterr().out
    assert "table t: dim 4, adagrad" in text and "rows on SSD 6" in text and "pending admission 2" in text
    report = json.loads((tmp_path / "report.json").read_text())
    hist = {b["count"]: b["rows"] for b in report["stores"][0]["tables"]["t"]["count_histogram"]}
    assert hist == {"2-3": 6}
    assert main(["export", str(path), str(tmp_path / "full")]) == 0
    # Key 1 was last seen in pass 1 of 3: unseen for one pass. Pending key 0 too (last seen in pass 0).
    assert main(["shrink", str(path), "--ttl-passes", "1"]) == 0
    assert "t: 1 rows deleted, 5 left" in capsys.readouterr().out
    assert main(["export", str(path), str(tmp_path / "delta"), "--since", str(first)]) == 0
    assert "t: 0 rows of dim 4, 1 deleted" in capsys.readouterr().out
    delta = json.loads((tmp_path / "delta" / "manifest.json").read_text())
    assert delta["tables"]["t"]["deleted"] == 1 and delta["tables"]["t"]["rows"] == 0
    served = serving.open(tmp_path / "full", deltas=[tmp_path / "delta"])
    np.testing.assert_array_equal(served.keys("t"), [2, 3, 4, 5, 6])
    assert main(["inspect", str(path), "--no-counts"]) == 0
    assert "rows on SSD 5, pending admission 1" in capsys.readouterr().out
    assert main(["export", str(path), str(tmp_path / "full")]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err


# -- settings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "value", "message"),
    [
        (AdmissionConfig, {"min_count": 0}, "admission.min_count: expected an int >= 1 or null. Got 0"),
        (AdmissionConfig, {"min_cont": 3}, "admission.min_cont: unknown key"),
        (
            AdmissionConfig,
            {"admit_probability": 1.5},
            "admission.admit_probability: expected a number <= 1.0",
        ),
        (AdmissionConfig, {"min_count": None}, "no key would ever be admitted"),
        (AdmissionConfig, {"unadmitted": "mean"}, "admission.unadmitted: expected one of"),
        (EvictionConfig, {"decay": 0}, "eviction.decay: expected a number > 0.0"),
        (EvictionConfig, {"every_passes": 5}, "eviction.every_passes: set to 5, but neither"),
        (EvictionConfig, [3], "eviction: expected a mapping"),
    ],
)
def test_bad_settings_name_the_key(cls, value, message):
    with pytest.raises(ConfigError, match=message):
        cls.parse(value)


def test_settings_errors_take_the_caller_key():
    with pytest.raises(ConfigError, match=r"^hierarchical_ps\.tables\.user\.admission\.min_count: "):
        AdmissionConfig.parse({"min_count": -1}, key="hierarchical_ps.tables.user.admission")
    assert EvictionConfig.parse({"ttl_passes": 7}).to_json()["ttl_passes"] == 7
