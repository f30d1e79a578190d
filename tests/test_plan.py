"""hierps.planning against what the store measures: rows per tier per pass, SSD bytes, files on disk."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import hierps
import hierps.planning as hp
from hierps import cli
from hierps._store import store_parts
from hierps.config import parse_size
from hierps.errors import ConfigError

DIM, KEYS, BATCH, PASSES = 16, 20_000, 4_000, 6
SPEC = hierps.TableSpec.of(optimizer="adam")


def zipf_passes(seed: int = 0, passes: int = PASSES, batch: int = BATCH) -> list[np.ndarray]:
    """Passes of ids of a power law over KEYS keys (exponent 1.1), as the scale bench draws them."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, KEYS + 1, dtype=np.float64) ** -1.1
    return [rng.choice(KEYS, size=batch, p=p / p.sum()).astype(np.int64) * 7 + 3 for _ in range(passes)]


def run_store(tmp_path, passes, *, memory_budget, pipeline, checkpoint):
    """Train every pass through a store; -> (its pass records, device hits per pass, the store)."""
    store = hierps.Store(
        tmp_path / "s", memory_budget=memory_budget, device_budget="64MiB", device="cpu", pipeline=pipeline
    )
    store.table("t", DIM, SPEC)
    device_hits, resident = [], np.empty(0, np.int64)
    for ids in passes:
        keys = np.unique(ids)
        device_hits.append(float(np.isin(keys, resident).mean()) if pipeline else 0.0)
        resident = keys
        store.begin_pass({"t": torch.from_numpy(ids)})
        store.gather("t", torch.from_numpy(keys), requires_grad=True).sum().backward()
        store.step()
        store.end_pass()
        if checkpoint:
            store.checkpoint()
    return store.stats.history, device_hits, store


@pytest.mark.parametrize(
    ("memory_budget", "pipeline", "checkpoint"),
    [("300KiB", True, True), ("150KiB", False, False), ("2MiB", True, False)],
)
def test_predicted_rows_bytes_and_hit_rates_match_a_measured_run(
    tmp_path, memory_budget, pipeline, checkpoint
):
    passes = zipf_passes()
    records, device_hits, store = run_store(
        tmp_path, passes, memory_budget=memory_budget, pipeline=pipeline, checkpoint=checkpoint
    )
    try:
        plan = hp.plan(
            {"t": hp.TableInput(dim=DIM, spec=SPEC)},
            hp.SampledTraffic({"t": np.concatenate(passes)}, BATCH),
            memory_budget=memory_budget,
            device_budget="64MiB",
            pipeline=pipeline,
            checkpoint_every=1 if checkpoint else None,
        )
        assert plan.sample_fraction == 1.0 and len(plan.passes) == len(records) == PASSES
        written_row = plan.tables[0].row["ssd_written"]
        exact_writes = 0
        for i, (want, got) in enumerate(zip(plan.passes, records, strict=True)):
            assert got.rows_loaded == pytest.approx(want.rows_loaded, rel=0.03), i
            assert got.ram_hit_rate == pytest.approx(want.ram_hit_rate, abs=0.05), i
            assert got.ssd_hit_rate == pytest.approx(want.ssd_hit_rate, abs=0.05), i
            assert device_hits[i] == pytest.approx(want.device_hit_rate, abs=0.05), i
            assert got.ssd_bytes_read == pytest.approx(want.ssd_bytes_read, rel=0.03, abs=2_000), i
            # The SSD tier counts a checkpoint's segment in the record of the pass after it, and a
            # compaction's output in the pass it ran in (not predicted: only ever more).
            written = want.ssd_bytes_written + (
                plan.passes[i - 1].checkpoint_rows * written_row if i else 0.0
            )
            assert got.ssd_bytes_written >= 0.97 * written - 2_000, i
            exact_writes += got.ssd_bytes_written == pytest.approx(written, rel=0.03, abs=2_000)
        assert exact_writes >= PASSES // 2
        assert max(r.ram_hit_rate + r.ssd_hit_rate for r in records) > 0.1  # rows came back: a real check
        usage = store.usage()
        if checkpoint:
            assert usage.ssd_rows == plan.tables[0].keys  # every key trained is on SSD after a checkpoint
            assert plan.ssd_live_bytes <= usage.disk_bytes <= plan.ssd_steady_bytes * 1.05
            # The index a store holds once every live segment's fences and filter are loaded: reopened
            # (this process holds the keys of the segments it wrote, and a lookup searches those instead
            # of loading a filter), then every key looked up.
            path = store.path
            store.close()
            store = hierps.Store(path, memory_budget=memory_budget, device="cpu")
            ssd = store_parts(store).core.ssd
            assert ssd.read("t", np.concatenate([k for k, _ in ssd.iter_rows("t")]))[0].all()
            assert plan.index_ram_bytes <= store.usage().index_ram_bytes <= 2 * plan.index_ram_bytes
        assert plan.ram_bytes <= store.settings.memory_budget
    finally:
        store.close()


def test_segment_bytes_are_those_the_store_writes(tmp_path):
    records, _, store = run_store(
        tmp_path, zipf_passes(), memory_budget="300KiB", pipeline=True, checkpoint=True
    )
    try:
        size = hp.row_bytes(DIM, SPEC)
        assert size.words == store.info("t").words and size.ram == store_parts(store).core.memory.row_bytes(
            "t"
        )
        ssd = store_parts(store).core.ssd
        segments = ssd.segments("t")
        assert len(segments) >= 2
        for table, seg in segments:
            folder = ssd.root / table / f"{seg:08d}"
            on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
            # Within 1%, but for the padding of a segment's last chunk of rows and of its filter (a page each).
            predicted = size.ssd_fixed + size.ssd * ssd.segment_size(table, seg)
            assert abs(on_disk - predicted) <= 0.01 * predicted + 2 * 4096, (seg, on_disk, predicted)
    finally:
        store.close()


def test_spatial_sampling_keeps_the_hit_rates():
    passes = zipf_passes(seed=1, passes=5, batch=20_000)
    tables = {"t": hp.TableInput(dim=DIM, spec=SPEC)}
    kw = {"memory_budget": "1MiB", "device_budget": "64MiB"}
    full = hp.plan(tables, hp.SampledTraffic({"t": np.concatenate(passes)}, 20_000), **kw)
    part = hp.plan(
        tables, hp.SampledTraffic({"t": np.concatenate(passes)}, 20_000), max_ids_per_pass=5_000, **kw
    )
    assert full.sample_fraction == 1.0 and part.sample_fraction == 0.25
    for name in ("device_hit_rate", "ram_hit_rate", "ssd_hit_rate"):
        assert part.mean(name, 1) == pytest.approx(full.mean(name, 1), abs=0.05), name
    assert part.mean("rows_loaded", 1) == pytest.approx(full.mean("rows_loaded", 1), rel=0.1)


def test_cli_plans_a_deepspeed_config_with_a_sample_and_warns_of_a_small_device_budget(tmp_path, capsys):
    passes = zipf_passes(passes=3)
    np.savez(tmp_path / "ids.npz", t=np.concatenate(passes))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "hierarchical_ps": {
            "path": str(tmp_path / "store"),
            "memory_budget": "300KiB",
            "device_budget": "64KiB",
            "optimizer": "adam",
        },
        "tables": {"t": {"dim": DIM, "keys": 10**6}},
    }
    (tmp_path / "ds.json").write_text(json.dumps(config))
    machine = {"disk_read": 1e9, "disk_write": 5e8, "ram_copy": 1e10}
    (tmp_path / "m.json").write_text(json.dumps(machine))
    out = tmp_path / "plan.json"
    argv = [
        "plan",
        str(tmp_path / "ds.json"),
        "--sample",
        str(tmp_path / "ids.npz"),
        "--examples-per-pass",
        str(BATCH),
    ]
    png = tmp_path / "plan.png"
    extra = ["--world-size", "2", "--json", str(out), "--plot", str(png)]
    assert cli.main([*argv, "--machine", str(tmp_path / "m.json"), *extra]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "device_budget 64.0 KiB cannot hold a pass's working set" in text
    got = hp.Plan.from_json(json.loads(out.read_text()))
    assert (
        got.world_size == 2 and got.tables[0].keys_per_rank == 500_000 and got.tables[0].optimizer == "adam"
    )
    assert got.ssd_live_bytes == pytest.approx(
        500_000 * got.tables[0].row["ssd"] + got.tables[0].row["ssd_fixed"]
    )
    assert got.total_ssd_bytes == 2 * got.ssd_live_bytes
    assert got.restore_seconds == pytest.approx(got.index_ram_bytes / 1e9)
    assert all(p.seconds_low <= p.seconds_high for p in got.passes)
    # The config's micro-batch cuts the sample into mini-batches, and its PassLoader halves a pass
    # after each that loads in groups.
    batches = [p.batches for p in got.passes]
    assert batches[:3] == [500, 250, 125] and sum(batches) == 3 * BATCH // 8
    assert got.passes[0].groups > 1 and got.passes[-1].groups == 1


def test_mini_batches_of_a_traffic_and_the_loaders_cuts():
    ids = np.arange(100, dtype=np.int64)
    sample = hp.SampledTraffic({"t": ids}, examples_per_pass=40, examples_per_batch=10)
    passes = list(sample.passes())
    # 10 mini-batches of 10 examples, 4 a pass: the last pass is partial, not dropped.
    assert [len(p) for p in passes] == [4, 4, 2] and sample.count == 3
    assert np.array_equal(np.concatenate([b["t"] for p in passes for b in p]), ids)
    with pytest.raises(ConfigError, match="examples_per_batch: expected a divisor of examples_per_pass"):
        hp.SampledTraffic({"t": ids}, examples_per_pass=40, examples_per_batch=15)
    law = hp.PowerLaw({"t": hp.TableDraw(1000, 1.1)}, examples_per_pass=400, count=2, examples_per_batch=100)
    whole = list(hp.PowerLaw({"t": hp.TableDraw(1000, 1.1)}, examples_per_pass=400, count=2).passes())
    for p, w in zip(law.passes(), whole, strict=True):  # the same draws, dealt out in order
        assert len(p) == 4 and np.array_equal(np.concatenate([b["t"] for b in p]), w["t"])
    with pytest.raises(ConfigError, match="pass_loader: the traffic needs its mini-batches"):
        hp.plan({"t": hp.TableInput(dim=DIM, spec=SPEC)}, hp.SampledTraffic({"t": ids}, 40), pass_loader=True)


def test_power_law_spec_in_yaml_and_bad_specs(tmp_path):
    (tmp_path / "p.yaml").write_text(
        "tables: {user: {dim: 64, keys: 1e9, optimizer: adam}}\n"
        "memory_budget: 64GiB\ndevice_budget: 16GiB\nworld_size: 8\n"
        "traffic: {power_law: {user: {exponent: 1.05}}, examples_per_pass: 1e7, passes: 3}\n"
    )
    p = hp.plan_from_spec(hp.read_spec(tmp_path / "p.yaml"), base=tmp_path)
    t = p.tables[0]
    assert t.keys == 10**9 and t.keys_per_rank == 125_000_000
    assert t.row["words"] == hierps.rows.row_layout("adam", 64).words
    assert p.sample_fraction < 1 and len(p.passes) == 3 and 0 < p.mean("device_hit_rate", 1) < 1
    with pytest.raises(ConfigError, match="table 'user' has the unknown key 'dims'"):
        hp.plan_from_spec({"tables": {"user": {"dim": 8, "dims": 8}}, "traffic": {}})
    with pytest.raises(ConfigError, match="unknown key 'budget'"):
        hp.plan_from_spec({"budget": 1})
    with pytest.raises(ConfigError, match="'traffic' needs 'sample'"):
        hp.plan_from_spec({"tables": {"user": {"dim": 8}}, "traffic": {"examples_per_pass": 3}})


def _assert_passes_as_planned(plan, records) -> None:
    """Each pass's rows loaded within 3%, its RAM and SSD hit rates within ±0.05 of the plan's."""
    for i, (want, got) in enumerate(zip(plan.passes, records, strict=True)):
        assert got.rows_loaded == pytest.approx(want.rows_loaded, rel=0.03), i
        assert got.ram_hit_rate == pytest.approx(want.ram_hit_rate, abs=0.05), i
        assert got.ssd_hit_rate == pytest.approx(want.ssd_hit_rate, abs=0.05), i


def test_a_demo_dlrm_run_is_predicted_from_a_sample_of_its_batches(tmp_path):
    """26 tables of the demo's DLRM trained pass by pass as ``hierps demo`` trains them (the next
    pass read ahead while one trains), planned from the ids of the very batches it trained on."""
    from hierps.demo.app import DemoConfig, build_model, load_data, table_names

    cfg = DemoConfig(examples=3_000, batch_size=150, pass_batches=3, memory_budget="64KiB", progress=False)
    train, _ = load_data(cfg)
    names = table_names(train.sparse.shape[1])
    batches = list(train.batches(cfg.batch_size, shuffle=True, seed=cfg.seed))
    passes = [batches[p : p + cfg.pass_batches] for p in range(0, len(batches), cfg.pass_batches)]
    assert len(names) == 26 and len(passes) == 6 and all(len(p) == cfg.pass_batches for p in passes)

    def pass_ids(group):
        return [{n: sparse[:, i] for i, n in enumerate(names)} for _, sparse, _ in group]

    store = hierps.Store(tmp_path / "s", memory_budget=cfg.memory_budget, device_budget=cfg.device_budget)
    try:
        model = build_model(store, cfg)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        for p, group in enumerate(passes):
            store.begin_pass(pass_ids(group))
            if p + 1 < len(passes):
                store.prefetch(pass_ids(passes[p + 1]))
            for dense, sparse, labels in group:
                loss_fn(model(dense, sparse), labels).backward()
                store.step()
            store.end_pass()
        records = store.stats.history
    finally:
        store.close()
    order = np.random.default_rng(cfg.seed).permutation(len(train))  # the batches' order
    sample = {n: train.sparse[order, i] for i, n in enumerate(names)}
    spec = hierps.TableSpec.of(optimizer="adagrad")
    plan = hp.plan(
        {n: hp.TableInput(dim=cfg.embedding_dim, spec=spec) for n in names},
        hp.SampledTraffic(sample, cfg.batch_size * cfg.pass_batches),
        memory_budget=cfg.memory_budget,
        device_budget=cfg.device_budget,
        checkpoint_every=None,
        read_ahead=True,
    )
    assert len(plan.passes) == len(records) == 6
    _assert_passes_as_planned(plan, records)
    # A record is taken while the pass's write-back may still run (its RAM bytes mid-eviction, in no
    # state a pass closes in): only the budget holds both.
    budget = parse_size(cfg.memory_budget)
    assert max(r.memory_bytes for r in records) <= budget and plan.ram_bytes <= budget
    # Bytes the SSD tier counts by the time a pass closes: written as the write-back evicts (at most
    # one write-back late), read as the read-ahead reads (at most one pass early).
    for name, early, late in (("ssd_bytes_written", 1, 0), ("ssd_bytes_read", 0, 1)):
        got = np.cumsum([getattr(r, name) for r in records])
        want = np.cumsum([getattr(p, name) for p in plan.passes])
        for i in range(len(records)):
            low, high = want[max(i - early, 0)] if i >= early else 0.0, want[min(i + late, len(want) - 1)]
            assert 0.97 * low - 2_000 <= got[i] <= 1.03 * high + 2_000, (name, i)
    read = sum(r.ssd_bytes_read for r in records)  # the last pass reads nothing ahead: all counted
    assert read == pytest.approx(sum(p.ssd_bytes_read for p in plan.passes), rel=0.03)
    assert max(r.ssd_hit_rate for r in records) > 0.2 and max(r.ram_hit_rate for r in records) > 0.02


def test_bench_plan_compares_the_scale_workload_on_the_machine_it_measured():
    from hierps.bench.plan import compare_scale
    from hierps.bench.scale import ScaleConfig, phase_config

    conf = phase_config(ScaleConfig(sizes=(100_000,), passes=3, batches=2, batch_keys=1_000))
    machine = hp.Machine(
        disk_read=1e9, disk_write=5e8, ram_copy=1e10, random_read=20_000.0, checkpoint_latency=0.01,
        segment_write=5e7, replace_rate=40_000.0,
    )  # fmt: skip
    measured = {
        "seconds": 0.2,
        "checkpoint_seconds": 0.1,
        "ssd_rows": 2_000,
        "ssd_bytes_read": 2_000 * 4 * 37,
    }
    results = {"config": conf, "sizes": [{"rows": 100_000, "phases": {"train": {"passes": [measured] * 3}}}]}
    (got,) = compare_scale(results, machine)
    words = hierps.rows.row_layout("adagrad", 16).words
    assert words == 37 and got["rows"] == 100_000
    # Every fresh key of a pass is read from the SSD tier (the bench wrote them all), one page each.
    assert got["ssd_rows_predicted"] == 2_000 and got["ssd_bytes_read_predicted"] == 2_000 * 4 * words
    assert got["stage_seconds"]["ssd_read"] == pytest.approx(2_000 / 20_000.0)
    ram = 2 * 2_000 * 4 * words / 1e10  # rows copied in and written back
    assert got["pass_seconds_high"] == pytest.approx(0.1 + ram) and got["pass_ratio"] == pytest.approx(
        0.2 / (0.1 + ram)
    )
    # The checkpoint after a pass: its 2,000 trained rows, each replacing its stored version.
    segment = 2_000 * hp.row_bytes(16, hierps.TableSpec()).ssd
    want = segment / 5e7 + 0.01 + 2_000 / 40_000.0
    assert got["checkpoint_seconds_predicted"] == pytest.approx(want, rel=1e-3)
    assert got["checkpoint_ratio"] == pytest.approx(0.1 / want, rel=1e-3)


def test_a_dropin_deepfm_run_is_predicted_from_a_sample_of_its_batches(tmp_path):
    """The drop-in DeepFM (``hierps bench --dropin``'s model: 26 ``nn.Embedding`` fields fed
    ``X[:, j:j+1].long()``) swapped into the store by ``hierps.deepspeed.initialize`` and trained
    pass by pass through a ``PassLoader``, its RAM tier a fraction of its rows and its device tier
    about one mini-batch's: the first passes load in groups, the loader halves the passes after each
    (4 mini-batches, then 2, then 1), the rest are pipelined. Planned from the ids of the very
    batches it trained on, with the store's mini-batches and the loader's cuts."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops

    import hierps.deepspeed as hds
    from hierps.bench._worker import one_rank_ds_config, single_rank_env
    from hierps.bench.dropin import FieldModel, _dataset, _loader

    single_rank_env()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # one rank: no shared-memory op
    cfg = {"rows": 40_000, "seed": 3, "examples": 4_096, "batch_size": 128}
    pass_batches, memory_budget, device_budget = 4, "384KiB", "256KiB"
    data, sizes, _ = _dataset(cfg)
    torch.manual_seed(0)
    section = {
        "path": str(tmp_path / "store"),
        "memory_budget": memory_budget,
        "device_budget": device_budget,
        "modules": "auto",
        "auto_min_rows": 1,
        "optimizer": {"type": "adagrad", "params": {"lr": 0.05}},
    }
    model = FieldModel(sizes, 16)
    engine, *_ = hds.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        config=one_rank_ds_config(cfg["batch_size"], section, dataloader_drop_last=True),
    )
    names = list(engine.hierps_modules)
    assert len(names) == 26

    def ids_of(batch):
        return {name: batch[0][:, 13 + j].long() for j, name in enumerate(names)}

    loss_fn = torch.nn.BCEWithLogitsLoss()
    try:
        for x, y in hds.PassLoader(_loader(data, cfg), ids_of, engine, pass_batches=pass_batches):
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        store = engine.hierps_store
        records = store.stats.history
    finally:
        engine.destroy()
    ids = data.tensors[0][:, 13:].long().numpy()
    spec = hierps.TableSpec.of(optimizer="adagrad")

    def planned(traffic):
        return hp.plan(
            {n: hp.TableInput(dim=16, keys=sizes[j], spec=spec) for j, n in enumerate(names)},
            traffic,
            memory_budget=memory_budget,
            device_budget=device_budget,
            checkpoint_every=None,
            read_ahead=True,
            copied_in=True,
            pass_loader=True,
        )

    sample = {n: ids[:, j] for j, n in enumerate(names)}
    batch = cfg["batch_size"]
    plan = planned(hp.SampledTraffic(sample, batch * pass_batches, examples_per_batch=batch))
    assert len(plan.passes) == len(records) == 1 + 1 + 26  # 32 mini-batches: 4, 2, then 1 a pass
    # The same plan from the batches of the user's own loader, taken as they come.
    from_loader = planned(
        hp.sample_loader(_loader(data, cfg), ids_of, batches=10**6, pass_batches=pass_batches)
    )
    assert from_loader.passes == plan.passes and from_loader.traffic["batches"] == 32
    assert [(p.batches, p.groups) for p in plan.passes[:3]] == [(4, 4), (2, 2), (1, 1)]
    assert any("load in groups" in w for w in plan.warnings)
    _assert_passes_as_planned(plan, records)
    # The store's worker scores its RAM tier at the pass that asked, so the replay is the store's count.
    assert [r.rows_loaded for r in records] == [round(p.rows_loaded) for p in plan.passes]
    read = sum(r.ssd_bytes_read for r in records)
    assert read == pytest.approx(sum(p.ssd_bytes_read for p in plan.passes), rel=0.03)
    assert max(r.ssd_hit_rate for r in records) > 0.2 and max(r.ram_hit_rate for r in records) > 0.02


def test_a_copy_in_needs_each_tables_rows_and_one_rank():
    traffic = hp.SampledTraffic({"t": np.concatenate(zipf_passes(passes=2))}, BATCH)
    with pytest.raises(ConfigError, match="copied_in: table 't' has no keys"):
        hp.plan({"t": hp.TableInput(dim=DIM, spec=SPEC)}, traffic, copied_in=True)
    with pytest.raises(ConfigError, match="copied_in: planned for one rank only"):
        hp.plan(
            {"t": hp.TableInput(dim=DIM, keys=KEYS * 7, spec=SPEC)}, traffic, copied_in=True, world_size=2
        )
    # Copied in, the first pass's rows come from the tiers (none is new); fresh, all are new.
    copied = hp.plan({"t": hp.TableInput(dim=DIM, keys=KEYS * 7 + 3, spec=SPEC)}, traffic, copied_in=True)
    fresh = hp.plan({"t": hp.TableInput(dim=DIM, keys=KEYS * 7 + 3, spec=SPEC)}, traffic)
    assert copied.passes[0].ram_hit_rate + copied.passes[0].ssd_hit_rate == pytest.approx(1.0)
    assert fresh.passes[0].ram_hit_rate + fresh.passes[0].ssd_hit_rate == 0.0


def test_bench_machine_probes_the_rates_a_plan_reads(tmp_path, capsys):
    out = tmp_path / "machine.json"
    argv = ["bench", "--machine", "--disk-bytes", "8MiB", "--tmp", str(tmp_path), "--json", str(out)]
    assert cli.main(argv) == 0
    assert "random 4 KiB reads, 16 in flight" in capsys.readouterr().out
    machine = hp.load_machine(out)
    for rate in ("disk_read", "disk_write", "ram_copy", "random_read", "segment_write", "replace_rate"):
        assert getattr(machine, rate) > 0, rate
    assert machine.checkpoint_latency is not None and machine.checkpoint_latency >= 0
    got = hp.plan(
        {"t": hp.TableInput(dim=DIM, spec=SPEC)},
        hp.SampledTraffic({"t": np.concatenate(zipf_passes(passes=2))}, BATCH),
        memory_budget="64KiB",
        machine=machine,
    )
    assert got.machine == machine.to_json() and all(p.seconds_high > 0 for p in got.passes[1:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["machine.json"]  # the probes' files are gone


def test_a_sample_of_the_users_loader_needs_whole_ids_and_a_batch():
    loader = [{"user": torch.tensor([[1, 2], [3, 3]]), "x": torch.zeros(2)} for _ in range(5)]
    traffic = hp.sample_loader(loader, {"user": "user"}, batches=3, pass_batches=2)
    assert [len(p) for p in traffic.passes()] == [2, 1] and traffic.examples_per_batch == 2
    assert np.array_equal(next(traffic.passes())[0]["user"], [1, 2, 3, 3])
    with pytest.raises(ConfigError, match="ids of 'x' are float32, not whole numbers"):
        hp.sample_loader([{"x": torch.tensor([0.5])}], {"x": "x"})
    with pytest.raises(ConfigError, match="sample_loader: the list gave no batch"):
        hp.sample_loader([], {"x": "x"})
