"""The ``hierps`` command: ``hierps demo``, ``hierps bench``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from hierps.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        examples=args.examples, data=args.data, max_rows=args.max_rows, batch_size=args.batch_size,
        pass_batches=args.pass_batches, memory_budget=args.memory_budget, device_budget=args.device_budget,
        store=args.store, seed=args.seed, progress=not args.no_progress,
    )
    result = run_demo(cfg)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from hierps.bench import run_from_args

    return run_from_args(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hierps", description="Hierarchical parameter store for sparse embeddings.")
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
    demo.set_defaults(func=_demo)

    from hierps.bench import add_arguments

    bench = sub.add_parser("bench", help="training throughput of hierps against PyTorch, DeepSpeed and a memmap")
    add_arguments(bench)
    bench.set_defaults(func=_bench)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
