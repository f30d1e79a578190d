"""A plan's inputs from a file: a small JSON/YAML spec, or a DeepSpeed config with its
``hierarchical_ps`` section (budgets, optimizer, precisions, pipeline, eviction come from it).

::

    tables:                       # name -> dim, keys (rows it will hold), optimizer, dtypes
      user: {dim: 64, keys: 1e9, optimizer: adam}
    memory_budget: 256GiB         # per rank; a DeepSpeed config's section gives these instead
    device_budget: 40GiB
    world_size: 8
    checkpoint_every: 1           # passes between checkpoints (null: none)
    read_ahead: false             # each pass announced while the one before trains (store.prefetch);
                                  #   default true with a hierarchical_ps section (PassLoader does it)
    restored: false               # the tables already hold their keys (a store opened at a checkpoint)
    copied_in: false              # each table's keys rows copied in before the first pass (a model's
                                  #   tables handed to hierps.deepspeed.initialize; one rank)
    pass_loader: false            # passes cut by a PassLoader, halved after one over the device budget;
                                  #   default true with a hierarchical_ps section and known mini-batches
    traffic:                      # a sample of batches ...
      sample: ids.npz             #   .npz / .parquet, one array (column) of ids per table
      examples_per_pass: 100000   #   a DeepSpeed config's default: pass_batches x its micro-batch
      examples_per_batch: 1000    #   the mini-batch (optional; a DeepSpeed config's micro-batch): a
                                  #   pass over the device budget is then loaded in the store's groups
    # traffic: {power_law: {user: {exponent: 1.05, ids_per_example: 1}}, examples_per_pass: 1e7, passes: 4}
    machine: machine.json         # `hierps bench --json` output, or {disk_read, disk_write, ram_copy}

Numbers may be written ``1e9``; sizes as ``"256GiB"``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hierps.config import TableSpec
from hierps.errors import ConfigError
from hierps.planning._machine import Machine, load_machine
from hierps.planning._plan import Plan, TableInput, plan
from hierps.planning._traffic import PowerLaw, TableDraw, Traffic, load_sample

__all__ = ["plan_from_spec", "read_spec"]

_KEYS = {
    "tables",
    "memory_budget",
    "device_budget",
    "world_size",
    "pipeline",
    "eviction",
    "checkpoint_every",
    "read_ahead",
    "restored",
    "copied_in",
    "pass_loader",
    "traffic",
    "machine",
    "hierarchical_ps",
}


def read_spec(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping in a ``.json`` / ``.yaml`` / ``.yml`` file (a spec or a DeepSpeed config)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"plan spec {str(p)!r}: cannot be read ({exc.strerror or exc}).") from None
    if p.suffix in (".yaml", ".yml"):
        import yaml  # type: ignore[import-untyped]

        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"plan spec {str(p)!r}: not JSON ({exc}); YAML files end in .yaml.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"plan spec {str(p)!r}: expected a mapping of settings at the top.")
    return data


def plan_from_spec(
    spec: Mapping[str, Any], base: str | os.PathLike[str] = ".", machine: Machine | None = None
) -> Plan:
    """The plan of a spec (see the module's docstring); relative paths in it are read from ``base``.
    In a DeepSpeed config (a ``hierarchical_ps`` section) the keys DeepSpeed knows are ignored; the
    plan's own keys, if present, override the section's."""
    folder = Path(base)
    section = _section(spec)
    known = _KEYS if "hierarchical_ps" not in spec else set(spec)
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ConfigError(f"plan spec: unknown key {unknown[0]!r}; the keys are {sorted(_KEYS)}.")
    tables = _tables(spec.get("tables"), section)
    traffic = _traffic(spec.get("traffic"), tables, folder, section)
    if machine is None and spec.get("machine") is not None:
        m = spec["machine"]
        machine = load_machine(folder / m if isinstance(m, str) else m)
    return plan(
        tables,
        traffic,
        memory_budget=spec.get("memory_budget", section.get("memory_budget", "1GiB")),
        device_budget=spec.get("device_budget", section.get("device_budget", "1GiB")),
        world_size=_int(spec.get("world_size", 1), "world_size"),
        pipeline=bool(spec.get("pipeline", section.get("pipeline", True))),
        eviction=spec.get("eviction", section.get("eviction", "lru")),
        checkpoint_every=None
        if spec.get("checkpoint_every", 1) is None
        else _int(spec.get("checkpoint_every", 1), "checkpoint_every"),
        machine=machine,
        read_ahead=bool(spec.get("read_ahead", "hierarchical_ps" in spec)),
        restored=bool(spec.get("restored", False)),
        copied_in=bool(spec.get("copied_in", False)),
        pass_loader=bool(
            spec.get("pass_loader", "hierarchical_ps" in spec and traffic.examples_per_batch is not None)
        ),
    )


def _section(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a DeepSpeed config's ``hierarchical_ps`` section gives a plan (checked as
    ``hierps.deepspeed`` checks them), or {}."""
    raw = spec.get("hierarchical_ps")
    if raw is None:
        return {}
    from hierps.integrations.config import parse_section

    cfg = parse_section(raw)
    micro = spec.get("train_micro_batch_size_per_gpu")
    return {
        "examples_per_batch": None if micro is None else _int(micro, "train_micro_batch_size_per_gpu"),
        "pass_batches": cfg.pass_batches,
        "memory_budget": cfg.memory_budget,
        "device_budget": cfg.device_budget,
        "pipeline": cfg.pipeline,
        "eviction": cfg.eviction,
        "spec": TableSpec(
            optimizer=cfg.optimizer, weights_dtype=cfg.weights_dtype, state_dtype=cfg.state_dtype
        ),
    }


def _tables(raw: Any, section: Mapping[str, Any]) -> dict[str, TableInput]:
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError(
            "plan spec: 'tables' must map each table's name to its settings, e.g. "
            "{'user': {'dim': 64, 'keys': 1e9, 'optimizer': 'adam'}}."
        )
    base: TableSpec = section.get("spec", TableSpec())
    out = {}
    for name, t in raw.items():
        if not isinstance(t, Mapping) or "dim" not in t:
            raise ConfigError(f"plan spec: table {name!r} needs at least its 'dim'. Got {t!r} instead.")
        extra = sorted(set(t) - {"dim", "keys", "optimizer", "weights_dtype", "state_dtype"})
        if extra:
            raise ConfigError(
                f"plan spec: table {name!r} has the unknown key {extra[0]!r}; a table takes dim, keys, "
                "optimizer, weights_dtype, state_dtype."
            )
        spec = TableSpec.of(
            base,
            optimizer=t.get("optimizer"),
            weights_dtype=t.get("weights_dtype"),
            state_dtype=t.get("state_dtype"),
        )
        keys = None if t.get("keys") is None else _int(t["keys"], f"tables.{name}.keys")
        out[str(name)] = TableInput(dim=_int(t["dim"], f"tables.{name}.dim"), keys=keys, spec=spec)
    return out


def _traffic(raw: Any, tables: Mapping[str, TableInput], folder: Path, section: Mapping[str, Any]) -> Traffic:
    if not isinstance(raw, Mapping):
        raise ConfigError(
            "plan spec: 'traffic' must be {'sample': 'ids.npz', 'examples_per_pass': N} or "
            "{'power_law': {table: {'exponent': s}}, 'examples_per_pass': N, 'passes': P}."
        )
    batch = raw.get("examples_per_batch", section.get("examples_per_batch"))
    batch = None if batch is None else _int(batch, "traffic.examples_per_batch")
    # A DeepSpeed config's PassLoader cuts passes of pass_batches micro-batches.
    default = batch * section["pass_batches"] if batch is not None and "pass_batches" in section else 0
    per_pass = _int(raw.get("examples_per_pass") or default, "traffic.examples_per_pass")
    if "sample" in raw:
        return load_sample(folder / str(raw["sample"]), per_pass, tables=None, examples_per_batch=batch)
    if "power_law" in raw:
        draws = {}
        for name, d in raw["power_law"].items():
            if name not in tables:
                raise ConfigError(f"traffic.power_law names table {name!r}, which 'tables' does not list.")
            keys = d.get("keys", tables[name].keys)
            if keys is None:
                raise ConfigError(f"traffic.power_law.{name}: give 'keys' (here or in the table).")
            draws[name] = TableDraw(
                keys=_int(keys, f"traffic.power_law.{name}.keys"),
                exponent=float(d.get("exponent", 1.0)),
                ids_per_example=_int(
                    d.get("ids_per_example", 1), f"traffic.power_law.{name}.ids_per_example"
                ),
            )
        return PowerLaw(
            draws,
            per_pass,
            count=_int(raw.get("passes", 4), "traffic.passes"),
            seed=_int(raw.get("seed", 0), "seed"),
            examples_per_batch=batch,
        )
    raise ConfigError("plan spec: 'traffic' needs 'sample' (a file of ids) or 'power_law'.")


def _int(value: Any, name: str) -> int:
    """An int from an int or a float that is one (``1e9``); ``ConfigError`` otherwise."""
    try:
        number = float(value) if isinstance(value, str) else value
    except ValueError:
        number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or float(number) != int(number):
        raise ConfigError(f"{name}: expected a whole number. Got {value!r} instead.")
    return int(number)
