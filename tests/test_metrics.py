"""hierps.metrics where ops teams look: a Prometheus endpoint scraped over loopback (training and
serving), and DeepSpeed's monitor (``csv_monitor``) writing the per-pass records under hierps.deepspeed.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from oracle import zipf_batches
from test_deepspeed import BAG, BATCH, VOCAB, ds_config, launcher_group, train_engine, twins

import hierps
from hierps import metrics, serving
from hierps.errors import ConfigError
from hierps.integrations import deepspeed as hds
from hierps.integrations.config import parse_section

# The Prometheus text format 0.0.4: comment lines, and samples `name{labels} value` (value as Go's
# ParseFloat reads it: numbers, NaN, +Inf, -Inf).
_COMMENT = re.compile(r"# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*) (.*)")
_SAMPLE = re.compile(
    r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*")*)?\})?'
    r" ([-+]?(\d+\.?\d*([eE][-+]?\d+)?|\.\d+([eE][-+]?\d+)?|NaN|Inf|nan|inf))"
)
_TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


def scrape(url: str) -> dict[str, float]:
    """GET ``url`` with a plain HTTP client -> sample name -> value; every line checked against the
    exposition format (a TYPE before its samples, one per name, known types)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    assert text.endswith("\n")
    samples: dict[str, float] = {}
    typed: dict[str, str] = {}
    for line in text.splitlines():
        comment = _COMMENT.fullmatch(line)
        if comment:
            kind, name, rest = comment.groups()
            if kind == "TYPE":
                assert rest in _TYPES and name not in typed, line
                typed[name] = rest
            continue
        sample = _SAMPLE.fullmatch(line)
        assert sample, f"not a sample line of the text format: {line!r}"
        name = sample.group(1)
        assert name in typed and name not in samples, line
        assert typed[name] != "counter" or name.endswith("_total"), line
        samples[name] = float(sample.group(5))
    return samples


def train_passes(store: hierps.Store, passes: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(passes):
        ids = torch.from_numpy(rng.integers(0, 300, 400))
        store.begin_pass({"t": ids})
        store.gather("t", torch.unique(ids), requires_grad=True).sum().backward()
        store.step()
        store.end_pass()


def test_training_endpoint_serves_the_last_pass_record_and_the_usage(make_store):
    store = make_store(memory_budget="3KiB", device_budget="1MiB")
    store.table("t", 4)
    train_passes(store, 3)
    store.checkpoint()
    with metrics.serve(0, store=store) as server:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics" and server.port > 0
        got = scrape(server.url)
        last = store.stats.last
        assert last is not None and last.pass_index == 2 and last.ram_rows > 0 and last.ssd_rows > 0
        for field in dataclasses.fields(hierps.PassRecord):
            assert got.pop(f"hierps_pass_{field.name}") == float(getattr(last, field.name)), field.name
        assert got.pop("hierps_passes_total") == 3.0
        usage = store.usage()  # nothing ran since the scrape: the same figures
        for name, value in dataclasses.asdict(usage).items():
            metric = f"hierps_{name}_total" if f"hierps_{name}_total" in got else f"hierps_{name}"
            assert got.pop(metric) == pytest.approx(value, rel=1e-12), name
        assert got == {}  # nothing else is served
        train_passes(store, 1, seed=1)  # a scrape reads the figures live
        again = scrape(server.url)
        assert again["hierps_passes_total"] == 4.0 and again["hierps_pass_pass_index"] == 3.0
        assert again["hierps_pass_rows_loaded"] == store.stats.last.rows_loaded
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=10)
    # Closed: the port is free again, and nothing listens there.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=10)
    with socket.socket() as s:  # binds only where no socket listens (connections may linger closing)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))


def test_serving_endpoint_counts_the_lookups_made(make_store, tmp_path):
    store = make_store(memory_budget="3KiB", device_budget="1MiB")
    store.table("t", 4)
    train_passes(store, 2)
    store.checkpoint()
    store.export(tmp_path / "export")
    tables = serving.open(tmp_path / "export", cache_bytes="1MiB")
    try:
        with metrics.serve(0, serving=tables) as server:
            zero = scrape(server.url)
            assert zero["hierps_serving_lookups_total"] == 0 and zero["hierps_serving_cache_hit_rate"] == 0
            tables.lookup("t", np.arange(50))  # 50 rows, all read from disk
            tables.lookup("t", np.r_[np.arange(30, 80), np.arange(30, 80)])  # 50 distinct: 20 cached
            got = scrape(server.url)
            assert got["hierps_serving_lookups_total"] == 100
            assert got["hierps_serving_cache_hits_total"] == 20
            assert got["hierps_serving_cold_reads_total"] == 80
            assert got["hierps_serving_cache_hit_rate"] == pytest.approx(0.2)
            assert got["hierps_serving_generation"] == 1 and got["hierps_serving_checkpoint"] == 1
            assert 0 < got["hierps_serving_lookups_per_second"] < math.inf
            assert 0 <= got["hierps_serving_staleness_seconds"] < 600
            assert not any(name.startswith("hierps_pass") for name in got)
    finally:
        tables.close()


def test_a_figure_that_cannot_be_read_answers_500_and_the_server_keeps_serving(make_store):
    store = make_store()
    store.table("t", 4)
    broken = {"on": True}

    def usage():
        if broken["on"]:
            raise RuntimeError("disk went away")
        return type(store).usage(store)

    store.usage = usage  # type: ignore[method-assign]
    with metrics.serve(0, store=store) as server:
        with pytest.raises(urllib.error.HTTPError, match="500") as err:
            urllib.request.urlopen(server.url, timeout=10)
        assert "disk went away" in err.value.read().decode()
        broken["on"] = False
        assert scrape(server.url)["hierps_passes_total"] == 0


def test_serve_refuses_nothing_to_serve_and_a_taken_port(make_store):
    with pytest.raises(ConfigError, match="give store="):
        metrics.serve(0)
    store = make_store()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{s.getsockname()[1]}"):
            metrics.serve(s.getsockname()[1], store=store)


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (None, None),
        (0, ("127.0.0.1", 0)),
        (9108, ("127.0.0.1", 9108)),
        ("9108", ("127.0.0.1", 9108)),
        ("0.0.0.0:9108", ("0.0.0.0", 9108)),
    ],
)
def test_metrics_port_setting(tmp_path, raw, want):
    section = parse_section({"path": str(tmp_path), "metrics_port": raw})
    assert section.metrics_port == want
    for bad in (-1, 70_000, "host:", ":9108", "a:b", True, 9108.0):
        with pytest.raises(ConfigError, match="hierarchical_ps.metrics_port"):
            parse_section({"path": str(tmp_path), "metrics_port": bad})


@pytest.fixture(scope="module")
def process_group():
    yield from launcher_group()


def read_series(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """The csv_monitor's files of hierps fields: field -> [(step, value)]."""
    out = {}
    for path in sorted(folder.glob("hierps_*.csv")):
        with path.open() as f:
            rows = list(csv.reader(f))
        field = path.stem.removeprefix("hierps_")
        assert rows[0] == ["step", field], path
        out[field] = [(int(step), float(value)) for step, value in rows[1:]]
    return out


def monitored_engine(tmp_path, **config_keys):
    """An engine of the test model whose DeepSpeed config writes ``csv_monitor`` files under tmp_path/csv/j."""
    _, model = twins()
    config = ds_config(tmp_path / "store", **config_keys.pop("section", {}))
    config.update(config_keys)
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "j"}
    engine, _, _, _ = hds.initialize(
        model=model,
        model_parameters=model.parameters(),
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        config=config,
    )
    return engine


def test_deepspeed_monitor_writes_each_pass_record_and_the_section_serves_metrics(tmp_path, process_group):
    engine = monitored_engine(tmp_path, section={"metrics_port": 0})
    try:
        server = engine.hierps_metrics
        assert server is not None and server.port > 0
        batches = zipf_batches(10, batch=BATCH, bag=BAG, vocab=VOCAB)
        train_engine(engine, batches[:8], pass_batches=4)
        mid = scrape(server.url)  # two passes closed
        assert mid["hierps_passes_total"] == 2.0 and mid["hierps_pass_pass_index"] == 1.0
        assert mid["hierps_pass_rows_loaded"] == engine.hierps_store.stats.last.rows_loaded
        train_engine(engine, batches[8:], pass_batches=4)  # a third, shorter pass
        history = list(engine.hierps_store.stats.history)
    finally:
        engine.destroy()
    with pytest.raises(urllib.error.URLError):  # destroy stopped the endpoint
        urllib.request.urlopen(server.url, timeout=10)
    assert len(history) == 3 and sum(r.ssd_rows for r in history) > 0
    series = read_series(tmp_path / "csv" / "j")
    assert sorted(series) == sorted(f.name for f in dataclasses.fields(hierps.PassRecord))
    steps = [4, 8, 10]  # the engine's global step when each pass closed
    for field, rows in series.items():
        assert rows == [(s, float(getattr(r, field))) for s, r in zip(steps, history, strict=True)], field


def test_a_loop_without_passes_reports_every_steps_per_print_steps(tmp_path, process_group):
    """The user's own loop, no PassLoader: the rows its gathers load on demand are recorded every
    ``steps_per_print`` steps (``on_demand``), and DeepSpeed's monitor writes them as it writes passes."""
    engine = monitored_engine(tmp_path, steps_per_print=3)
    try:
        store = engine.hierps_store
        train_engine(engine, zipf_batches(10, batch=BATCH, bag=BAG, vocab=VOCAB))
        last = store.record_stats()  # the 10th step, not recorded yet
        assert store.record_stats() is None  # nothing since
        history = list(store.stats.history)
    finally:
        engine.destroy()
    assert [(r.on_demand, r.steps, r.pass_index) for r in history] == [(True, 3, 0)] * 3 + [(True, 1, 0)]
    assert last is history[-1]
    # The model's table was copied in: its rows come from the RAM and SSD tiers as the gathers ask.
    assert history[0].rows_loaded > 0 and sum(r.ssd_rows for r in history) > 0
    series = read_series(tmp_path / "csv" / "j")
    assert series["on_demand"] == [(3, 1.0), (6, 1.0), (9, 1.0), (10, 1.0)]
    steps = (3, 6, 9, 10)
    assert series["rows_loaded"] == [(s, float(r.rows_loaded)) for s, r in zip(steps, history, strict=True)]


def test_a_pass_record_round_trips_and_reads_a_record_older_than_its_last_fields(make_store):
    store = make_store(memory_budget="4KiB")
    store.table("t", 4)
    train_passes(store, 2)
    record = store.stats.last
    assert hierps.PassRecord.from_json(record.to_json()) == record and record.steps > 0
    older = {k: v for k, v in record.to_json().items() if k not in ("steps", "on_demand")}
    assert hierps.PassRecord.from_json(older) == dataclasses.replace(record, steps=0, on_demand=False)
    with pytest.raises(ConfigError, match=r"missing \['rows_loaded'\], unknown \['rows'\]"):
        hierps.PassRecord.from_json({**{k: v for k, v in older.items() if k != "rows_loaded"}, "rows": 1})
