"""``hierps bench --scale --plan``: the planner's pass, checkpoint and row figures against those the
scale bench measures, on the bench's own workload and the disk it probed in the same run.

The bench writes every key of its table and checkpoints it, then trains passes of fresh keys (each
row read cold from the SSD tier) with a checkpoint after each pass. The planner is given the same
table, budgets and keys (:func:`hierps.planning.plan` with ``restored=True``: every key is stored)
and the machine the run measured: the disk's sequential rates and its random 4 KiB reads
(``disk.sequential``, ``disk.random_4k``), a RAM copy and a checkpoint's latency and segment write rate
(:func:`hierps.planning.checkpoint_costs`) probed here. It does not see the bench's
timings. Its pass time is a bound on the store's work (the bench's compute is a sum of squares),
its checkpoint time the checkpoint's segment at that write rate plus that latency.

``hierps bench --machine`` runs the same probes alone and writes the machine a plan reads
(``hierps plan SPEC --machine FILE``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hierps.config import TableSpec

__all__ = ["compare_scale", "run_from_args", "run_machine", "scale_machine"]


def scale_machine(results: dict[str, Any], ram_copy: float | None = None) -> Any:
    """The :class:`hierps.planning.Machine` of a scale bench's disk probes (``ram_copy``: bytes/s,
    probed now when None)."""
    from hierps.bench.machine import ram_copy as probe_ram
    from hierps.planning import Machine, checkpoint_costs

    disk = results["disk"]
    latency, segment_write, replace_rate = checkpoint_costs(results["config"]["tmp"])
    return Machine(
        disk_read=float(disk["sequential"]["bytes_per_s"]),
        disk_write=float(disk["sequential"]["write_bytes_per_s"]),
        ram_copy=ram_copy if ram_copy is not None else float(probe_ram(64 << 20, repeats=3)["bytes_per_s"]),
        random_read=float(disk["random_4k"]["reads_per_s"]),
        checkpoint_latency=latency,
        segment_write=segment_write,
        replace_rate=replace_rate,
        name="hierps bench --scale (this run's disk probes)",
    )


def compare_scale(results: dict[str, Any], machine: Any = None) -> list[dict[str, Any]]:
    """Per size whose train phase finished: the plan's figures next to the measured ones (medians
    over the passes after the first, which also loads the segments' filters)."""
    import hierps.planning as hp
    from hierps.bench.scale import _fresh_keys

    conf = results["config"]
    machine = machine if machine is not None else scale_machine(results)
    out = []
    for size in results.get("sizes", []):
        train = size["phases"].get("train")
        if not train or "error" in train:
            continue
        rows = int(size["rows"])
        keys = _fresh_keys(conf, rows)
        plan = hp.plan(
            {"t": hp.TableInput(dim=conf["dim"], keys=rows, spec=TableSpec.of(optimizer="adagrad"))},
            hp.SampledTraffic({"t": keys.reshape(-1)}, conf["batches"] * conf["batch_keys"]),
            memory_budget=conf["memory_budget"],
            device_budget=conf["device_budget"],
            checkpoint_every=1,
            machine=machine,
            restored=True,
        )
        measured, predicted = train["passes"][1:] or train["passes"], plan.passes[1:] or plan.passes
        record = {
            "rows": rows,
            "pass_seconds": statistics.median(p["seconds"] for p in measured),
            "pass_seconds_low": statistics.median(p.seconds_low for p in predicted),
            "pass_seconds_high": statistics.median(p.seconds_high for p in predicted),
            "checkpoint_seconds": statistics.median(p["checkpoint_seconds"] for p in measured),
            "checkpoint_seconds_predicted": plan.checkpoint_seconds,
            "ssd_rows": statistics.median(p["ssd_rows"] for p in measured),
            "ssd_rows_predicted": statistics.median(p.ssd_rows for p in predicted),
            "ssd_bytes_read": statistics.median(p["ssd_bytes_read"] for p in measured),
            "ssd_bytes_read_predicted": statistics.median(p.ssd_bytes_read for p in predicted),
            "stage_seconds": predicted[0].stage_seconds,
            "machine": machine.to_json(),
        }
        record["pass_ratio"] = record["pass_seconds"] / max(record["pass_seconds_high"], 1e-12)
        record["checkpoint_ratio"] = record["checkpoint_seconds"] / max(
            record["checkpoint_seconds_predicted"], 1e-12
        )
        out.append(record)
    return out


def format_comparison(records: list[dict[str, Any]], out: Callable[[str], Any] = print) -> None:
    out("planned against measured (medians of the passes after the first; ratio: measured / planned):")
    for r in records:
        out(
            f"  {r['rows']:,} rows: pass {r['pass_seconds']:.3f} s, planned {r['pass_seconds_low']:.3f}-"
            f"{r['pass_seconds_high']:.3f} s ({r['pass_ratio']:.2f}x the stages one after another); checkpoint "
            f"{r['checkpoint_seconds']:.3f} s, planned {r['checkpoint_seconds_predicted']:.3f} s "
            f"({r['checkpoint_ratio']:.2f}x); SSD rows a pass {r['ssd_rows']:,.0f}, planned "
            f"{r['ssd_rows_predicted']:,.0f}; bytes read {r['ssd_bytes_read']:,.0f}, planned "
            f"{r['ssd_bytes_read_predicted']:,.0f}"
        )


def run_from_args(args: argparse.Namespace) -> int:
    """``hierps bench --scale --plan``: the scale bench, then the planner against it (in its JSON
    under ``"plan"``)."""
    from hierps.bench.scale import config_from_args, plot, run_cli, run_scale

    def run(cfg: Any) -> dict[str, Any]:
        results = run_scale(cfg)
        results["plan"] = compare_scale(results)
        format_comparison(results["plan"])
        return results

    results = run_cli(args, "scale", config_from_args, run)
    if results is None:
        return 2
    if args.plot:
        plot(results, args.plot)
    return 0


def run_machine(args: argparse.Namespace) -> int:
    """``hierps bench --machine [--disk-bytes SIZE] [--tmp DIR] [--json FILE]``: the rates a plan's
    times are bounded by, probed on this machine (:func:`hierps.planning.measure_machine` with the
    disk's random reads), written as what ``hierps plan --machine FILE`` reads."""
    import dataclasses

    from hierps.config import parse_size
    from hierps.planning import measure_machine

    size = args.disk_bytes or ("256MiB" if args.quick else "1GiB")
    print(f"hierps bench --machine: probing {args.tmp or 'the system temp dir'} with {size}")
    m = measure_machine(args.tmp, parse_size(size, "--disk-bytes"), random_reads=True)
    m = dataclasses.replace(m, name=f"hierps bench --machine ({platform.node() or 'this machine'})")
    print(f"  RAM copy: {m.ram_copy / 1e9:.2f} GB/s")
    print(
        f"  disk: sequential write (with fsync) {m.disk_write / 1e9:.2f} GB/s, cold read {m.disk_read / 1e9:.2f} GB/s"
    )
    print(f"  disk: random 4 KiB reads, 16 in flight: {m.random_read or 0:,.0f} reads/s")
    print(
        f"  store checkpoints: {(m.checkpoint_latency or 0) * 1e3:.2f} ms per segment made durable, segments "
        f"written at {(m.segment_write or 0) / 1e6:.0f} MB/s, {m.replace_rate or 0:,.0f} replaced rows located per second"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": m.to_json()}, indent=1), encoding="utf-8")
        print(f"  written to {args.json}: hierps plan SPEC --machine {args.json}")
    return 0
