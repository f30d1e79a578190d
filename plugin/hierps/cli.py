"""The ``hierps`` command: ``demo``, ``bench``, ``plan``, and ``inspect`` / ``export`` / ``shrink`` of a store directory."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hierps.errors import ConfigError, HierpsError

__all__ = ["main"]


def _demo_online(args: argparse.Namespace) -> int:
    from hierps.demo.online import OnlineConfig, run_online

    _check_json_target(args.json)
    cfg = OnlineConfig(
        files=args.files,
        rows_per_file=args.file_rows,
        interval=args.interval,
        batch_size=args.batch_size,
        memory_budget=args.memory_budget,
        directory=args.store,
        seed=args.seed,
    )
    _write_json(args.json, run_online(cfg))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from hierps.demo.app import DemoConfig, run_demo

    if args.online:
        return _demo_online(args)

    given = ("examples", "data", "max_rows", "batch_size", "pass_batches", "memory_budget", "device_budget")
    _check_json_target(args.json)
    cfg = DemoConfig(
        **{name: getattr(args, name) for name in (*given, "store", "seed")}, progress=not args.no_progress
    )
    result = run_demo(cfg)
    _write_json(args.json, result)
    return 0


def _check_json_target(path: str | None) -> None:
    """``--json PATH``: a file that can be written, checked before the work it reports on."""
    if path is None:
        return
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        problem = "is a directory"
    elif not folder.is_dir():
        problem = f"its directory {str(folder)!r} does not exist"
    elif not os.access(folder, os.W_OK):
        problem = f"its directory {str(folder)!r} is not writable"
    else:
        return
    raise ConfigError(f"--json {path!r}: {problem}; give a file path in an existing, writable directory.")


def _write_json(path: str | None, report: Any) -> None:
    """Write ``report`` to ``--json PATH`` (if given); ``ConfigError`` when the file cannot be written."""
    if path is None:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    except OSError as exc:
        raise ConfigError(f"--json {path!r}: cannot be written ({exc.strerror or exc}).") from exc


def _bench(args: argparse.Namespace) -> int:
    from hierps.bench.run import run_from_args

    return run_from_args(args)


def _ref(text: str) -> int | str:
    """A checkpoint reference from the command line: an id (digits) or a tag."""
    return int(text) if text.isdigit() else text


def _inspect(args: argparse.Namespace) -> int:
    from hierps.lifecycle._inspection import format_report, inspect_path

    _check_json_target(args.json)
    report = inspect_path(args.path, counts=not args.no_counts)
    print(format_report(report))
    sharded = _sharded_parts(args.path)
    if sharded is not None:
        report["sharded"] = sharded
        elsewhere = sharded["ranks_elsewhere"]
        print(
            f"sharded store: latest checkpoint {sharded['checkpoint']} ({sharded['tag']}) of "
            f"{sharded['world_size']} ranks; parts here: ranks {sharded['ranks_here']}"
            + (f"; on other hosts' disks (not here): ranks {elsewhere}" if elsewhere else "")
        )
    _write_json(args.json, report)
    return 0


def _sharded_parts(path: str) -> dict[str, Any] | None:
    """For a directory of rank stores: its latest checkpoint (from the records of the lowest rank
    directory here: on a host's own disk, rank 0's may be elsewhere) and which parts are here."""
    from hierps.storage._commit_log import rank_dir, rank_dirs, read_records, store_uid

    dirs = rank_dirs(path)
    records = next((found for q in sorted(dirs) if (found := read_records(dirs[q]))), [])
    if not records:
        return None
    latest = records[-1]
    here = [q for q in range(latest.world_size) if store_uid(rank_dir(path, q)) == latest.stores[q]]
    return {
        "checkpoint": latest.id,
        "tag": latest.tag,
        "world_size": latest.world_size,
        "ranks_here": here,
        "ranks_elsewhere": [q for q in range(latest.world_size) if q not in here],
    }


def _export(args: argparse.Namespace) -> int:
    from hierps.lifecycle._export import export_store

    since = _ref(args.since) if args.since is not None else None
    ckpt = _ref(args.checkpoint) if args.checkpoint is not None else None
    manifest = export_store(args.path, args.out, since=since, checkpoint=ckpt, dtype=args.dtype)
    kind = f"delta since checkpoint {manifest['since']}" if manifest["since"] is not None else "full export"
    print(f"{args.out}: {kind} of checkpoint {manifest['checkpoint']}")
    for name, t in manifest["tables"].items():
        gone = f", {t['deleted']} deleted" if manifest["since"] is not None else ""
        dtype = f" in {t['dtype']}" if t["dtype"] != "fp32" else ""
        print(f"  {name}: {t['rows']} rows of dim {t['dim']}{dtype}{gone}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from hierps.planning import format_plan, load_machine, measure_machine, plan_from_spec, read_spec

    _check_json_target(args.json)
    spec = read_spec(args.spec)
    for key in ("world_size", "memory_budget", "device_budget"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    if args.sample is not None:
        spec["traffic"] = {
            "sample": str(Path(args.sample).resolve()),
            "examples_per_pass": args.examples_per_pass,
        }
        if args.examples_per_batch is not None:
            spec["traffic"]["examples_per_batch"] = args.examples_per_batch
    machine = None
    if args.machine == "measure":
        machine = measure_machine(args.tmp)
    elif args.machine is not None:
        machine = load_machine(args.machine)
    result = plan_from_spec(spec, base=Path(args.spec).parent, machine=machine)
    print(format_plan(result))
    _write_json(args.json, result.to_json())
    if args.plot:
        from hierps.planning import plot_plan

        plot_plan(result, args.plot)
    return 0


def _shrink(args: argparse.Namespace) -> int:
    from hierps._store import Store
    from hierps.lifecycle._export import store_dirs
    from hierps.sharding._commits import update_each_rank

    def shrink(path: Path, store: Store) -> None:
        if args.table is not None and args.table not in store.tables:
            raise ConfigError(f"{path}: no table {args.table!r}; it has {sorted(store.tables)}")
        deleted = store.shrink(
            args.table, ttl_passes=args.ttl_passes, min_decayed_count=args.min_decayed_count
        )
        for name, n in deleted.items():
            active = args.ttl_passes is not None or args.min_decayed_count is not None
            rule = (
                ""
                if active or store.tables[name].eviction.active
                else (" (no eviction settings: pass --ttl-passes or --min-decayed-count)")
            )
            print(f"{path}: {name}: {n} rows deleted, {store.num_rows(name)['ssd']} left{rule}")

    root = Path(args.path)
    if store_dirs(root) == [root]:
        with Store(root, device="cpu") as store:
            shrink(root, store)
            ckpt = store.checkpoint("shrink")
    else:  # every rank's store, committed as one checkpoint of the ranks
        ckpt = update_each_rank(root, lambda rank, store: shrink(store.path, store), "shrink", device="cpu")
    print(f"{root}: checkpoint {ckpt}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hierps", description="Hierarchical parameter store for sparse embeddings."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a DLRM click model through the store (rows spill to SSD)")
    demo.add_argument("--data", help="Criteo TSV file or directory (default: synthetic Criteo-format data)")
    demo.add_argument("--max-rows", type=int, default=None, help="read at most this many rows of --data")
    demo.add_argument("--examples", type=int, default=300_000, help="synthetic examples (train + test)")
    demo.add_argument("--batch-size", type=int, default=2048)
    demo.add_argument("--pass-batches", type=int, default=16, help="mini-batches per pass")
    demo.add_argument("--memory-budget", default="4MiB", help="RAM tier budget, e.g. 4MiB")
    demo.add_argument("--device-budget", default="512MiB", help="device tier budget")
    demo.add_argument("--store", default=None, help="store directory (default: a temporary one)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", help="also write the per-pass record as JSON here")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    online = demo.add_argument_group("the online loop (--online)")
    online.add_argument(
        "--online",
        action="store_true",
        help="follow a directory of Parquet logs as they arrive, train in passes of event time, publish a "
        "delta after each pass and serve it; prints the staleness per pass",
    )
    online.add_argument("--files", type=int, default=10, help="log files written, one per pass (--online)")
    online.add_argument("--file-rows", type=int, default=8192, help="examples per log file (--online)")
    online.add_argument("--interval", type=float, default=1.0, help="seconds between log files (--online)")
    demo.set_defaults(func=_demo)

    from hierps.bench.run import add_arguments

    bench = sub.add_parser(
        "bench", help="training throughput of hierps against PyTorch, DeepSpeed and a memmap"
    )
    add_arguments(bench)
    bench.set_defaults(func=_bench)

    insp = sub.add_parser("inspect", help="tables, rows, bytes on disk, checkpoints and counters of a store")
    insp.add_argument("path", help="store directory (or a directory of rank-* stores)")
    insp.add_argument(
        "--no-counts", action="store_true", help="skip the histogram of counters (reads every row)"
    )
    insp.add_argument("--json", help="also write the report as JSON here")
    insp.set_defaults(func=_inspect)

    exp = sub.add_parser("export", help="write a checkpoint's weights (or a delta) as a plain Zarr v3 group")
    exp.add_argument("path", help="store directory (or a directory of rank-* stores, merged into one export)")
    exp.add_argument("out", help="new directory for the export")
    exp.add_argument("--since", help="checkpoint id or tag: export only what changed since it (a delta)")
    exp.add_argument("--checkpoint", help="checkpoint id or tag to export (default: the latest)")
    exp.add_argument(
        "--dtype",
        default="fp32",
        help="precision of the exported weights: fp32 (default) or fp16 (half the bytes)",
    )
    exp.set_defaults(func=_export)

    shr = sub.add_parser("shrink", help="delete rows unseen for long from every tier, then checkpoint")
    shr.add_argument(
        "path", help="store directory (or a directory of rank-* stores); nothing else may have it open"
    )
    shr.add_argument("--ttl-passes", type=int, default=None, help="delete rows unseen for this many passes")
    shr.add_argument(
        "--min-decayed-count", type=float, default=None, help="delete rows whose decayed count is below this"
    )
    shr.add_argument("--table", default=None, help="only this table (default: all)")
    shr.set_defaults(func=_shrink)

    pln = sub.add_parser(
        "plan",
        help="bytes per tier, hit rates per pass and times of a store, before it trains (hierps.planning)",
    )
    pln.add_argument(
        "spec", help="a plan spec (.json / .yaml) or a DeepSpeed config with 'tables' beside its section"
    )
    pln.add_argument("--sample", help="a sample of batches (.npz / .parquet, one array of ids per table)")
    pln.add_argument(
        "--examples-per-pass",
        type=int,
        default=0,
        help="examples of the sample in one pass (a DeepSpeed config's default: pass_batches micro-batches)",
    )
    pln.add_argument(
        "--examples-per-batch",
        type=int,
        help="examples of one mini-batch (a DeepSpeed config's default: its micro-batch): a pass over the "
        "device budget is planned in the groups the store loads it in",
    )
    pln.add_argument("--world-size", type=int, help="ranks (default: the spec's, else 1)")
    pln.add_argument("--memory-budget", help="RAM tier budget per rank (default: the spec's or section's)")
    pln.add_argument("--device-budget", help="device tier budget per rank (default: the spec's or section's)")
    pln.add_argument(
        "--machine", help="`hierps bench --json` output or a machine JSON; 'measure' to probe now"
    )
    pln.add_argument("--tmp", help="with --machine measure: a directory on the store's disk")
    pln.add_argument("--json", help="also write the plan as JSON here")
    pln.add_argument("--plot", help="also draw bytes per tier and hit rates per pass as a PNG here")
    pln.set_defaults(func=_plan)

    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except HierpsError as exc:  # a bad path or setting: its message says what to do
        print(f"hierps {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
