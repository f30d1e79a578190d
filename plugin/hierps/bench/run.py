"""``hierps bench``: training throughput of hierps against PyTorch, DeepSpeed and a memmap, in one run.

Each measurement runs in a fresh process (``python -m hierps.bench.run --worker SPEC --out FILE``,
JSON in and out), so peak RSS is per variant and no variant warms another's caches. Repeats
are interleaved (every variant once, then again) so that load from other jobs on the machine
spreads over all variants; the median is reported. See :mod:`hierps.bench.variants` for the
trainers, :mod:`hierps.bench.machine` for the machine limits and the SSD scaling experiment,
:mod:`hierps.bench.report` for the table, the goal check and the chart.

Workload: the demo DLRM on synthetic Criteo-like data, 26 power-law features over an id
population of ``rows`` ids. The RAM budgets of the hierps variants are fractions of the bytes of
the rows the workload creates (its distinct ids), so a 25% budget really keeps three quarters
of the rows on SSD.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hierps.bench._worker import median_record
from hierps.bench._worker import spawn as spawn_worker

__all__ = [
    "ALL_VARIANTS",
    "BenchConfig",
    "add_arguments",
    "config_from_args",
    "quick_config",
    "run_bench",
    "run_from_args",
]

ALL_VARIANTS = (
    "mlp-only",
    "torch-sparse",
    "torch-dense",
    "deepspeed-dense",
    "mmap",
    *(f"hierps-ram{pct}-{mode}" for pct in (100, 25, 5) for mode in ("pipe", "sync")),
    "hierps-ram25-pipe-compact",
    "hierps-ram5-pipe-compact",
)
FULL_VARIANTS = ("deepspeed-dense", "hierps-ram100-pipe")


@dataclass
class BenchConfig:
    """Settings of one ``hierps bench`` run; the defaults take four to eight minutes on two cores."""

    model: str = "dlrm"  # "dlrm" (the demo model) or "wide" (logistic regression: embedding-bound)
    rows: int = 1_000_000  # id population over the 26 features (torch tables have this many rows)
    dim: int = 16
    batch_size: int = 4096
    examples: int = 65_536  # per epoch; each variant trains a warm-up epoch, then a measured one
    pass_batches: int = 4  # mini-batches per hierps pass: 4 passes per epoch by default
    repeats: int = 3
    seed: int = 0
    threads: int = 1  # torch intra-op threads: on two cores the pipeline's worker needs the other
    dense_steps: int = 8  # measured steps of the dense variants (dense Adam touches every row)
    dense_warmup_steps: int = 2
    device_budget: str = "1GiB"
    lr_sparse: float = 0.05
    lr_dense: float = 1e-3
    variants: tuple[str, ...] = ALL_VARIANTS
    machine: bool = True  # RAM / disk bandwidth and the SSD tier's cold read
    disk_bytes: int = 1 << 30
    scaling: tuple[int, ...] = (100_000, 1_000_000)  # rows on SSD in the scaling experiment
    full: bool = False  # also 10M-row comparison against deepspeed-dense (and 10^7 rows on SSD)
    full_rows: int = 10_000_000
    full_dense_steps: int = 3
    tmp: str | None = None  # directory for stores and probe files (default: the system temp dir)
    profile: str | None = None  # write a cProfile summary per variant here (extra, untimed runs)
    worker_timeout: float = 1800.0


def quick_config(**overrides: Any) -> BenchConfig:
    """About a minute and a half on two cores: one repeat of a half-size workload, a smaller disk probe."""
    base = {
        "examples": 32_768,
        "pass_batches": 2,
        "repeats": 1,
        "dense_steps": 3,
        "dense_warmup_steps": 1,
        "disk_bytes": 256 << 20,
    }
    return BenchConfig(**{**base, **overrides})


# -- workers ----------------------------------------------------------------------------------------
def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one measurement in this process (the ``--worker`` entry point)."""
    import torch

    torch.set_num_threads(spec["config"]["threads"])
    if spec["task"] == "scale":  # one phase of hierps bench --scale, which measures it itself
        from hierps.bench.scale import run_phase

        return run_phase(spec)
    if spec["task"] == "dropin":  # one variant of hierps bench --dropin
        from hierps.bench.dropin import run_phase as run_dropin_phase

        return run_dropin_phase(spec)
    if spec["task"] == "dlrm-ref":  # one variant of hierps bench --model dlrm-ref
        from hierps.bench.dlrm_ref import run_phase as run_ref_phase

        return run_ref_phase(spec)
    if spec["task"] == "serving":  # one phase of hierps bench --serving
        from hierps.bench.serving import run_phase as run_serving_phase

        return run_serving_phase(spec)
    from hierps.bench import machine as bench_machine
    from hierps.bench import variants as bench_variants
    from hierps.bench.variants import peak_rss_bytes, run_variant

    cfg, tmp, task = spec["config"], Path(spec["tmp"]), spec["task"]
    t0 = time.perf_counter()
    profiler = cProfile.Profile() if spec.get("profile") else None
    bench_variants.PROFILER = profiler
    if task == "variant":
        record = run_variant(spec["name"], cfg, tmp)
    elif task == "machine":
        ram = bench_machine.ram_copy()
        disk = bench_machine.disk_read(tmp, cfg["disk_bytes"])
        record = {
            "ram_copy": ram,
            "disk_read": disk,
            "ssd_tier_read": bench_machine.ssd_tier_read(cfg, tmp, disk_bytes_per_s=disk["bytes_per_s"]),
        }
    elif task == "scaling":
        record = bench_machine.ssd_scaling(spec["rows"], cfg, tmp)
    else:
        raise ValueError(f"unknown bench task {task!r}")
    if profiler:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).strip_dirs()
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(35)
        Path(spec["profile"]).write_text(text.getvalue(), encoding="utf-8")
        profiler.dump_stats(Path(spec["profile"]).with_suffix(".prof"))  # for pstats / snakeviz
    record["peak_rss_bytes"] = peak_rss_bytes()
    record["process_seconds"] = time.perf_counter() - t0
    record["torch_threads"] = torch.get_num_threads()
    return record


# -- the run ------------------------------------------------------------------------------------------
def run_bench(
    cfg: BenchConfig, out: Callable[[str], Any] = print, only_scaling: bool = False
) -> dict[str, Any]:
    """Run every measurement of ``cfg``; print progress and the report; return the JSON-ready results."""
    from hierps.bench.report import check_goals, format_report
    from hierps.bench.variants import make_workload

    unknown = sorted(set(cfg.variants) - set(ALL_VARIANTS))
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose among {', '.join(ALL_VARIANTS)}.")
    conf = asdict(cfg)
    conf["variants"], conf["scaling"] = list(cfg.variants), list(cfg.scaling)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "config": conf,
        "variants": {},
        "machine": {},
        "scaling": [],
        "load_average_start": os.getloadavg(),
        "cpu_count": os.cpu_count(),
    }
    if not only_scaling:
        work = make_workload(conf)
        results["distinct_ids"] = work.distinct_ids
        out(
            f"hierps bench: {cfg.examples} examples per epoch in {len(work.passes)} passes of {cfg.pass_batches} "
            f"batches of {cfg.batch_size}; {work.distinct_ids:,} distinct ids of a {cfg.rows:,}-id population; "
            f"dim {cfg.dim}; torch threads {cfg.threads}; {cfg.repeats} repeats; load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
        del work
    with tempfile.TemporaryDirectory(prefix="hierps-bench-", dir=cfg.tmp) as tmp_dir:
        tmp = Path(tmp_dir)
        counter = iter(range(1 << 30))

        def spawn(task: str, config: dict[str, Any], label: str, **extra: Any) -> dict[str, Any]:
            spec = {"task": task, "config": config, "tmp": str(tmp / f"{next(counter):03d}-{label}"), **extra}
            t0 = time.perf_counter()
            record = spawn_worker(spec, cfg.worker_timeout)
            status = (
                f"{record['examples_per_s']:.0f} examples/s"
                if "examples_per_s" in record
                else "failed"
                if "error" in record
                else "done"
            )
            out(
                f"  [{time.perf_counter() - started:6.0f} s] {label}: {status} ({time.perf_counter() - t0:.0f} s)"
            )
            return record

        if cfg.machine and not only_scaling:
            results["machine"] = spawn("machine", conf, "machine-limits")
        if not only_scaling:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cfg.variants}
            for r in range(cfg.repeats):
                for name in cfg.variants:
                    runs[name].append(spawn("variant", conf, f"{name}#{r + 1}", name=name))
            results["variants"] = {name: median_record(rs) for name, rs in runs.items()}
            if cfg.profile:
                Path(cfg.profile).mkdir(parents=True, exist_ok=True)
                for name in cfg.variants:
                    spawn(
                        "variant",
                        conf,
                        f"{name}-profiled",
                        name=name,
                        profile=str(Path(cfg.profile).resolve() / f"{name}.txt"),
                    )
        if cfg.full and not only_scaling:
            big = {**conf, "rows": cfg.full_rows, "dense_steps": cfg.full_dense_steps}
            full_runs: dict[str, list[dict[str, Any]]] = {name: [] for name in FULL_VARIANTS}
            for r in range(cfg.repeats):
                for name in FULL_VARIANTS:
                    full_runs[name].append(
                        spawn("variant", big, f"{name}@{cfg.full_rows:.0e}#{r + 1}", name=name)
                    )
            results["full_comparison"] = {name: median_record(rs) for name, rs in full_runs.items()}
        for n in cfg.scaling:
            record = spawn("scaling", conf, f"ssd-scaling-{n:.0e}", rows=n)
            results["scaling"].append({"rows": n, **record})
    results["goals"] = check_goals(results)
    results["seconds"] = time.perf_counter() - started
    results["load_average_end"] = os.getloadavg()
    format_report(results, out)
    out(f"bench took {results['seconds']:.0f} s")
    return results


# -- command line -------------------------------------------------------------------------------------
def _count(text: str) -> int:
    """An int >= 1 from the command line."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1. Got {text!r} instead.")
    return value


def _fraction(text: str) -> float:
    """A float > 0 from the command line."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0. Got {text!r} instead.")
    return value


def _counts(text: str) -> tuple[int, ...]:
    """Comma-separated ints >= 1 from the command line."""
    return tuple(_count(item) for item in text.split(",") if item.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hierps bench``."""
    a = parser.add_argument
    a("--examples", type=_count, help="examples per epoch (default 65536; --quick 32768)")
    a(
        "--model",
        choices=("dlrm", "wide", "dlrm-ref"),
        help="dlrm (the demo model, default), wide (embedding-bound), or dlrm-ref: instead, the reference "
        "DLRM (dlrm's Criteo Kaggle setup, bags of ids, 7.9M rows) in plain PyTorch, TorchRec (DMP, FBGEMM's "
        "fused tables) and hierps in RAM, on SSD and without a PassLoader, on the same batches "
        "(hierps.bench.dlrm_ref)",
    )
    a(
        "--max-ind-range",
        type=_count,
        help="with --model dlrm-ref: rows per table at most (default 1466000: 7.9M rows in all)",
    )
    a(
        "--optimizer",
        choices=("sgd", "adagrad"),
        help="with --model dlrm-ref: optimizer of the tables and the dense layers (default sgd)",
    )
    a("--rows", type=_count, help="id population over the 26 features (default 1000000)")
    a("--dim", type=_count, help="embedding dim (default 16)")
    a("--batch-size", type=_count, help="default 4096")
    a("--pass-batches", type=_count, help="mini-batches per hierps pass (default 4; --quick 2)")
    a("--repeats", type=_count, help="runs per variant, the median is reported (default 3; --quick 1)")
    a("--threads", type=_count, help="torch intra-op threads of each run (default 1)")
    a("--dense-steps", type=_count, help="measured steps of the dense variants (default 8)")
    a("--variants", help=f"comma-separated subset of {','.join(ALL_VARIANTS)}")
    a("--quick", action="store_true", help="a half-size workload, one repeat, a 256MiB disk probe")
    a(
        "--full",
        action="store_true",
        help="also the 10M-row comparison with deepspeed-dense, and 10^7 rows in the scaling experiment "
        "(with --scale: also 10^8 rows)",
    )
    a("--scaling", action="store_true", help="run only the SSD scaling experiment")
    a("--no-scaling", action="store_true", help="skip the SSD scaling experiment")
    a("--no-machine", action="store_true", help="skip the RAM / disk / SSD tier bandwidth probes")
    a(
        "--machine",
        action="store_true",
        help="instead: probe this machine only (RAM copy, the disk's sequential and random 4 KiB reads, "
        "store checkpoints in --tmp) and write with --json what `hierps plan --machine FILE` reads",
    )
    a("--disk-bytes", help="size of the disk probe file (default 1GiB; --quick 256MiB)")
    a("--tmp", help="directory for stores and probe files (default: the system temp dir; put it on the SSD)")
    a(
        "--profile",
        metavar="DIR",
        help="also write a cProfile summary (NAME.txt) and its stats (NAME.prof) of the measured epoch of one extra run per variant into DIR",
    )
    a(
        "--scale",
        action="store_true",
        help="instead: the store at 10^6 and 10^7 rows (--full: also 10^8), write / train / reopen / wide / "
        "export / serving / reshard (2 ranks -> 1) each in a fresh process: seconds, peak RSS against its limit, "
        "I/O, files (hierps.bench.scale)",
    )
    a(
        "--plan",
        action="store_true",
        help="with --scale: also the planner's pass and checkpoint times against it",
    )
    a(
        "--numpy-too",
        action="store_true",
        help="with --scale: also the wide and export phases with the numpy kernels instead of the compiled "
        "core, on the same store and disk",
    )
    a(
        "--core",
        action="store_true",
        help="instead: the CPU per 4 KiB chunk the SSD tier spends reading (lookups, scans, a quarter of the "
        "rows) from the page cache, compiled core against numpy, beside the bare reads (hierps.bench.core)",
    )
    a(
        "--serving",
        action="store_true",
        help="instead: serving an export at 10^6 and 10^7 rows (--full: also 10^8): open time, lookup latency "
        "and rate, cold and warm, against numpy in RAM; peak RSS (hierps.bench.serving)",
    )
    a(
        "--dist",
        action="store_true",
        help="instead: the sharded store at one rank against one store (same run), its all-to-all bytes "
        "against the minimum, and per-rank CPU time and bytes per example at 1, 2 and 4 ranks "
        "(hierps.bench.dist; also python -m hierps.bench_dist)",
    )
    a(
        "--hosts",
        action="store_true",
        help="with --dist: 2 test hosts x 2 ranks against 1 host x 4 ranks (bytes within and across hosts), and "
        "a reshard 4 -> 2 across hosts against the link and the disk (network namespaces; root only)",
    )
    a(
        "--dropin",
        action="store_true",
        help="instead: a plain-PyTorch model (nn.Embedding per field) trained through hierps.deepspeed.initialize "
        "with a device tier smaller than its tables, on demand and with the loader of training_data, against "
        "plain PyTorch (hierps.bench.dropin)",
    )
    a(
        "--device-fraction",
        type=_fraction,
        help="with --dropin: the device tier's budget as a fraction of the rows an epoch uses (default 0.5; "
        "above 1 it holds every table, 0.15 about 2.5 batches' rows at batch 256)",
    )
    a("--cache-bytes", help="with --serving: the row cache of hierps.serving.open (default 64MiB)")
    a(
        "--sizes",
        type=_counts,
        help="with --scale / --serving: comma-separated table sizes (default 1000000,10000000)",
    )
    a("--passes", type=_count, help="with --scale: passes of 4 x 4096 fresh keys per size (default 8)")
    a(
        "--memory-budget",
        help="with --scale: the store's RAM budget (default 256MiB); with --model dlrm-ref: hierps-ssd's (default 64MiB)",
    )
    a("--device-budget", help="with --model dlrm-ref: every hierps variant's device tier (default 512MiB)")
    a(
        "--keep",
        action="store_true",
        help="with --scale / --serving: keep the stores and exports (under --tmp)",
    )
    a(
        "--phases",
        help="with --scale: comma-separated phases to run (default all; write is required unless only reshard)",
    )
    a(
        "--precision",
        action="store_true",
        help="instead: AUC of compact rows and FTRL against fp32 Adagrad on the demo data, MovieLens-100k and "
        "Adult over several seeds, and bytes per row (hierps.bench.precision)",
    )
    a(
        "--precision-datasets",
        default="demo,movielens,adult",
        help="with --precision: comma-separated data sets among demo, movielens, adult (default all)",
    )
    a(
        "--precision-settings",
        help="with --precision: comma-separated settings (default all; see hierps.bench.precision)",
    )
    a("--seeds", type=_count, default=3, help="with --precision: seeds per setting (default 3)")
    a("--json", metavar="PATH", help="write the results as JSON here")
    a("--plot", metavar="PATH", help="write a PNG chart here")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` of parsed ``hierps bench`` options (``--quick`` defaults under given ones)."""
    from hierps.config import parse_size

    given = {
        "examples": args.examples,
        "model": args.model,
        "rows": args.rows,
        "dim": args.dim,
        "batch_size": args.batch_size,
        "pass_batches": args.pass_batches,
        "repeats": args.repeats,
        "threads": args.threads,
        "dense_steps": args.dense_steps,
        "tmp": args.tmp,
        "profile": args.profile,
        "disk_bytes": parse_size(args.disk_bytes, "--disk-bytes") if args.disk_bytes else None,
        "variants": tuple(v for v in args.variants.split(",") if v) if args.variants else None,
        "machine": False if args.no_machine else None,
        "full": True if args.full else None,
    }
    cfg = (quick_config if args.quick else BenchConfig)(**{k: v for k, v in given.items() if v is not None})
    if args.no_scaling:
        cfg.scaling = ()
    elif args.scaling or args.full:
        cfg.scaling = (*(cfg.scaling or BenchConfig.scaling), *((cfg.full_rows,) if args.full else ()))
    return cfg


def run_from_args(args: argparse.Namespace) -> int:
    """``hierps bench``: run, print the report, write ``--json`` / ``--plot``."""
    if args.machine:
        from hierps.bench.plan import run_machine

        return run_machine(args)
    if args.scale:
        from hierps.bench import plan, scale

        return (plan if args.plan else scale).run_from_args(args)
    if args.core:
        from hierps.bench.core import run_from_args as run_core

        return run_core(args)
    if args.serving:
        from hierps.bench.serving import run_from_args as run_serving

        return run_serving(args)
    if args.dist:
        from hierps.bench.dist import run_distributed_bench, run_hosts_bench

        cfg = config_from_args(args)
        workload: dict[str, Any] = {
            "rows": args.rows or 200_000,
            "dim": cfg.dim,
            "batch_size": cfg.batch_size,
            "pass_batches": args.pass_batches or 8,
            "memory_budget": args.memory_budget or "64MiB",
        }
        given = args.examples or args.quick
        results = (
            run_hosts_bench(examples=cfg.examples if given else 32_768, **workload)
            if args.hosts
            else run_distributed_bench(
                examples=cfg.examples if given else 65_536, repeats=cfg.repeats, **workload
            )
        )
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
        return 0
    if args.model == "dlrm-ref" and args.dropin:
        print(
            "hierps bench: --dropin trains its own DeepFM-style model; --model dlrm-ref is a bench of its own. "
            "Give one of them.",
            file=sys.stderr,
        )
        return 2
    if args.device_fraction is not None and not args.dropin:
        print(
            "hierps bench: --device-fraction sizes the device tier of --dropin only; the other benches set "
            "--device-budget or their own budgets.",
            file=sys.stderr,
        )
        return 2
    if args.model == "dlrm-ref":
        from hierps.bench.dlrm_ref import run_from_args as run_ref

        return run_ref(args)
    if args.dropin:
        from hierps.bench.dropin import run_from_args as run_dropin

        return run_dropin(args)
    if args.precision:
        from hierps.bench.precision import run_from_args as run_precision

        return run_precision(args)
    cfg = config_from_args(args)
    unknown = sorted(set(cfg.variants) - set(ALL_VARIANTS))
    if unknown:
        print(
            f"hierps bench: unknown variant(s) {unknown}; choose among {','.join(ALL_VARIANTS)}.",
            file=sys.stderr,
        )
        return 2
    results = run_bench(cfg, only_scaling=args.scaling)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
    if args.plot:
        from hierps.bench.report import plot

        plot(results, args.plot)
    return 0


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hierps.bench.run", description="one hierps bench measurement"
    )
    parser.add_argument("--worker", required=True, help="JSON spec of the measurement")
    parser.add_argument("--out", required=True, help="write the JSON record here")
    args = parser.parse_args(argv)
    record = _worker(json.loads(args.worker))
    Path(args.out).write_text(json.dumps(record), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
