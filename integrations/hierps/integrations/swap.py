"""What a swap into the store leaves behind: a report anyone can read, and old weights that fail loudly.

:func:`report_swap` says which embedding modules of a model went into the store and which stayed
dense, and why (one line for the log, warnings where ``"auto"`` left an embedding dense).
:func:`check_not_shared` refuses a weight that other layers use too (tied weights).
:func:`retire_weights` turns the old ``nn.Embedding`` / ``nn.EmbeddingBag`` weights into
:class:`StaleWeight`: code that kept a reference to them (a list of weights for L2
regularisation, the old module object itself) gets a :class:`hierps.errors.StaleWeightError`
naming the table at its first use, instead of silently reading or training a tensor that no longer
takes part in training.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
from torch import nn

from hierps.errors import ConfigError, StaleWeightError
from hierps.integrations.config import SECTION, HierarchicalPSConfig, embedding_modules

__all__ = [
    "DenseEmbeddingWarning",
    "StaleWeight",
    "SwapReport",
    "check_not_shared",
    "report_swap",
    "retire_weights",
]


class DenseEmbeddingWarning(UserWarning):
    """``"modules": "auto"`` left an embedding dense (or swapped none): DeepSpeed trains it."""


@dataclass
class SwapReport:
    """Which embedding modules went into the store (name -> rows) and which stayed dense (name -> why)."""

    swapped: dict[str, int] = field(default_factory=dict)
    dense: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        """One line for the log: ``hierarchical_ps: 2 of 3 embedding modules in the store: ...``."""
        total = len(self.swapped) + len(self.dense)
        stored = ", ".join(f"{n} ({rows:,} rows)" for n, rows in self.swapped.items()) or "none"
        text = f"{SECTION}: {len(self.swapped)} of {total} embedding modules in the store: {stored}"
        if self.dense:
            text += "; dense, trained by DeepSpeed: " + ", ".join(
                f"{n} ({why})" for n, why in self.dense.items()
            )
        return text


def report_swap(model: nn.Module, chosen: Mapping[str, nn.Module], cfg: HierarchicalPSConfig) -> SwapReport:
    """The report of swapping ``chosen`` out of ``model``; warns (:class:`DenseEmbeddingWarning`) when
    ``"auto"`` swapped nothing or left an embedding dense. Call before the swap."""
    taken = {id(m) for m in chosen.values()}
    report = SwapReport()
    for name, module in embedding_modules(model).items():
        rows = module.num_embeddings
        if id(module) in taken:
            report.swapped[name] = rows
        elif cfg.modules == "auto":
            report.dense[name] = f"{rows:,} rows < auto_min_rows={cfg.auto_min_rows:,}"
        else:
            report.dense[name] = "not listed in modules"
    fix = (
        f'List the tables to swap in "modules" (e.g. {list(report.dense)[:2]}), or lower "auto_min_rows" '
        "(1 swaps every embedding)."
    )
    if cfg.modules == "auto" and report.dense:
        if not report.swapped:
            warnings.warn(
                f'{SECTION}: "modules": "auto" swapped none of the model\'s {len(report.dense)} embedding modules '
                f"(the largest has {max(m.num_embeddings for m in embedding_modules(model).values()):,} rows, "
                f"under auto_min_rows={cfg.auto_min_rows:,}), so nothing is kept in the store and DeepSpeed "
                f"trains every table densely. {fix}",
                DenseEmbeddingWarning,
                stacklevel=3,
            )
        else:
            warnings.warn(
                f"{SECTION}: {len(report.dense)} embedding module(s) stay dense, trained by DeepSpeed: "
                + ", ".join(f"{n} ({why})" for n, why in report.dense.items())
                + f". {fix}",
                DenseEmbeddingWarning,
                stacklevel=3,
            )
    elif not report.swapped and not report.dense:
        warnings.warn(
            f"{SECTION}: the section is enabled but the model has no nn.Embedding or nn.EmbeddingBag; "
            "nothing is kept in the store.",
            DenseEmbeddingWarning,
            stacklevel=3,
        )
    return report


def check_not_shared(model: nn.Module, chosen: Mapping[str, nn.Module]) -> None:
    """Raise ``ConfigError`` when a chosen embedding's weight is also a parameter of another module
    (a tied output layer, say): the store would train the rows and the other module a stale copy."""
    owner = {id(m.weight): name for name, m in chosen.items()}
    members = {id(m) for m in chosen.values()}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        if id(module) in members:
            continue
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in owner:
                where = f"{mod_name}.{p_name}" if mod_name else p_name
                raise ConfigError(
                    f"{SECTION}.modules: the weight of {owner[id(p)]!r} is also {where!r} (tied weights); "
                    "its rows would train in the store while the other layer kept a stale copy. Untie "
                    "them, or leave this embedding out of modules."
                )


class StaleWeight(nn.Parameter):
    """An embedding weight whose rows moved into a hierps store. Shape, dtype and device can be read;
    any other use raises :class:`~hierps.errors.StaleWeightError` naming the table.

    Its values are gone (the tensor is a zero-stride view of one zero: the table's memory is
    freed); the rows live in the store, read by ``module.lookup(ids)`` of the hierps module.
    """

    hierps_table: str
    hierps_module: str
    _METADATA: ClassVar[frozenset[str]] = frozenset(
        {"shape", "dtype", "device", "requires_grad", "is_leaf", "ndim", "layout", "grad", "is_sparse"}
    )
    _METHODS: ClassVar[frozenset[str]] = frozenset({"size", "dim", "numel", "__hash__"})

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        if name in cls._METHODS or (name == "__get__" and owner in cls._METADATA):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        stale = next((a for a in _flat(args, kwargs) if isinstance(a, StaleWeight)), None)
        if name == "__repr__" and stale is not None:
            return f"StaleWeight(table={stale.hierps_table!r}, shape={tuple(stale.shape)})"
        table = stale.hierps_table if stale is not None else "?"
        module = stale.hierps_module if stale is not None else "?"
        raise StaleWeightError(
            f"the weight of embedding {module!r} was used ({name or func}), but its rows moved into the hierps "
            f"store (table {table!r}) when hierps.deepspeed.initialize swapped the module; this old tensor "
            f"is no longer trained. Use the module the model holds now (engine.module.{module}), read rows "
            f"with engine.module.{module}.lookup(ids), and drop references to the old weight (e.g. from a "
            "list of weights for L2 regularisation: the store's optimizer applies to the rows)."
        )


def _flat(args: Any, kwargs: Any) -> list[Any]:
    out: list[Any] = []
    for a in [*args, *(kwargs or {}).values()]:
        out.extend(a if isinstance(a, (list, tuple)) else [a])
    return out


def retire_weights(chosen: Mapping[str, nn.Module], tables: Mapping[str, str]) -> None:
    """Make each swapped module's old weight a :class:`StaleWeight` (its memory freed).

    ``tables``: module name -> store table. Call once the swap can no longer be undone.
    """
    for name, module in chosen.items():
        weight = module.weight
        if not isinstance(weight, nn.Parameter) or isinstance(weight, StaleWeight):
            continue  # a module listed under two names
        with torch.no_grad():
            weight.data = torch.zeros(1, dtype=weight.dtype, device=weight.device).expand(weight.shape)
        weight.grad = None
        weight.__class__ = StaleWeight
        stale = cast(StaleWeight, weight)
        stale.hierps_table = tables.get(name, name)
        stale.hierps_module = name
