"""The store's and the serving tables' figures where ops teams look: Prometheus and DeepSpeed's monitor.

::

    server = hierps.metrics.serve(9108, store=store)          # training: http://127.0.0.1:9108/metrics
    server = hierps.metrics.serve(9108, serving=tables)       # serving
    server.close()

A scrape reads the figures live (nothing runs between scrapes), in the Prometheus text format
(version 0.0.4), on a plain ``http.server`` thread bound to ``host`` (loopback unless told):

- training (:class:`hierps.Store`): the last pass's :class:`hierps.PassRecord` as gauges
  ``hierps_pass_<field>``, passes closed as ``hierps_passes_total``, and the store's running
  totals from :meth:`hierps.Store.usage` (``hierps_ssd_bytes_read_total``, ...);
- serving (:func:`hierps.serving.open`): ``hierps_serving_lookups_total`` (rows looked up: each
  call's distinct ids), ``hierps_serving_cache_hits_total``, ``hierps_serving_cold_reads_total``
  (rows read from disk), ``hierps_serving_cache_hit_rate``, ``hierps_serving_lookups_per_second``
  (since the server started), ``hierps_serving_generation``, ``hierps_serving_checkpoint`` and
  ``hierps_serving_staleness_seconds`` (since the newest export followed was written).

:func:`monitor_events` turns a pass record into DeepSpeed monitor events
(``engine.monitor.write_events``); ``hierps.deepspeed`` writes them at each pass with no user code.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hierps.errors import ConfigError
from hierps.storage._export_format import MANIFEST
from hierps.tiers._stats import PassRecord

__all__ = ["MetricsServer", "monitor_events", "render", "serve", "serving_samples", "store_samples"]

Sample = tuple[str, str, str, float]  # (name, type, help, value)
_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def monitor_events(record: PassRecord, step: int, prefix: str = "hierps/") -> list[tuple[str, float, int]]:
    """A pass record -> ``[(prefix + field, value, step)]``, what DeepSpeed's ``write_events`` takes."""
    return [(prefix + name, value, step) for name, value in record.metrics.items()]


def store_samples(store: Any) -> list[Sample]:
    """The figures of a :class:`hierps.Store` (its last pass record, its usage totals)."""
    out: list[Sample] = [("hierps_passes_total", "counter", "Passes closed.", float(store.passes))]
    last = store.stats.last
    if last is not None:
        for name, value in last.metrics.items():
            out.append(
                (f"hierps_pass_{name}", "gauge", f"The last pass's {name} (hierps.PassRecord).", value)
            )
    usage = store.usage()
    for name, value in usage.__dict__.items():
        kind = (
            "counter"
            if name.startswith(("ssd_bytes", "ssd_rows_written", "evicted")) or name.endswith("seconds")
            else "gauge"
        )
        metric = f"hierps_{name}" + ("_total" if kind == "counter" else "")
        out.append((metric, kind, f"hierps.StoreUsage.{name}.", float(value)))
    return out


def serving_samples(tables: Any, started: float) -> list[Sample]:
    """The figures of serving tables (:func:`hierps.serving.open`); ``started``: when counting began."""
    info = tables.cache_info()
    lookups = info["hits"] + info["misses"]
    try:  # an export's manifest is written last, just before the export is renamed into place
        written = os.stat(tables.applied[-1] / MANIFEST).st_mtime
    except OSError:
        written = time.time()
    return [
        (
            "hierps_serving_lookups_total",
            "counter",
            "Rows looked up (each call's distinct ids).",
            float(lookups),
        ),
        ("hierps_serving_cache_hits_total", "counter", "Rows found in the row cache.", float(info["hits"])),
        (
            "hierps_serving_cold_reads_total",
            "counter",
            "Rows read from disk (cache misses).",
            float(info["misses"]),
        ),
        (
            "hierps_serving_cache_hit_rate",
            "gauge",
            "Cache hits over lookups since open.",
            info["hits"] / max(lookups, 1),
        ),
        (
            "hierps_serving_lookups_per_second",
            "gauge",
            "Rows looked up per second since the metrics server started.",
            lookups / max(time.monotonic() - started, 1e-9),
        ),
        ("hierps_serving_generation", "gauge", "Chains served so far (1 at open).", float(tables.generation)),
        (
            "hierps_serving_checkpoint",
            "gauge",
            "The checkpoint the rows are as of.",
            float(tables.checkpoint),
        ),
        (
            "hierps_serving_staleness_seconds",
            "gauge",
            "Seconds since the newest export followed was written.",
            max(0.0, time.time() - written),
        ),
    ]


def render(samples: list[Sample]) -> str:
    """Samples in the Prometheus text exposition format."""
    lines = []
    for name, kind, help_text, value in samples:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value!r}"]
    return "\n".join(lines) + "\n"


class MetricsServer:
    """A running endpoint (see :func:`serve`): ``url``, ``port``, ``close()``; a context manager."""

    def __init__(self, collect: Callable[[], list[Sample]], host: str, port: int) -> None:
        def handler_get(handler: BaseHTTPRequestHandler) -> None:
            if handler.path.split("?")[0] not in ("/metrics", "/"):
                handler.send_error(404, "the metrics are at /metrics")
                return
            try:
                body = render(collect()).encode()
            except Exception as exc:  # a figure that cannot be read now: say so, keep serving
                handler.send_error(500, "hierps figures unavailable", f"{type(exc).__name__}: {exc}")
                return
            handler.send_response(200)
            handler.send_header("Content-Type", _CONTENT_TYPE)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)

        handler = type(
            "_Handler",
            (BaseHTTPRequestHandler,),
            {"do_GET": handler_get, "log_message": lambda self, *a: None},
        )
        try:
            self._server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ConfigError(
                f"metrics: cannot listen on {host}:{port} ({exc.strerror or exc}); pick another port, or 0 for any free one."
            ) from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="hierps-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self._server.server_address[0]!s}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(port: int = 0, *, store: Any = None, serving: Any = None, host: str = "127.0.0.1") -> MetricsServer:
    """Serve the figures of ``store`` and / or ``serving`` at ``http://host:port/metrics`` (port 0:
    any free one, see ``.port``) until ``close()``."""
    if store is None and serving is None:
        raise ConfigError("metrics.serve: give store= (a hierps.Store) or serving= (hierps.serving tables).")
    started = time.monotonic()

    def collect() -> list[Sample]:
        out = store_samples(store) if store is not None else []
        return out + (serving_samples(serving, started) if serving is not None else [])

    return MetricsServer(collect, host, port)
