"""What a swap into the store leaves behind: a report anyone can read, and old weights that fail loudly.

:func:`report_swap` says which embedding modules of a model went into the store and which stayed
dense, and why (one line for the log, warnings where ``"auto"`` left an embedding dense).
:func:`check_not_shared` refuses a weight that other layers use too (tied weights).
:func:`retire_weights` turns the old ``nn.Embedding`` / ``nn.EmbeddingBag`` weights into
:class:`StaleWeight`: code that kept a reference to them (a list of weights for L2
regularisation, the old module object itself) gets a :class:`hierps.errors.StaleWeightError`
naming the table at its first use, instead of silently reading or training a tensor that no longer
takes part in training.
:func:`materialize` gives the layers of a model built on the ``meta`` device, once its tables are
in the store, memory and torch's initial values.
"""

from __future__ import annotations

import math
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
    "materialize",
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


def materialize(model: nn.Module, device: torch.device) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Give each parameter and buffer of ``model`` still on the meta device memory on ``device`` and
    torch's initial values; returns ``id(old) -> (old, new)`` for whoever holds the old tensors (a
    client optimizer, ``model_parameters``). A model with nothing on the meta device is left as is.

    Call it once the tables are swapped out: what is left is the dense part, small by design. A
    tensor shared by several modules stays shared (``nn.Module.to_empty`` would untie it). Then
    every module holding a meta tensor of its own runs its ``reset_parameters()`` once, in
    ``model.modules()`` order, drawing from torch's generator as it stands when this runs.

    What that reproduces: the values an eager build (``torch.manual_seed(s); model = Net()``) gives
    these layers, bit for bit, when the generator is consumed in the same order: each module's
    construction initialises it as its ``reset_parameters()`` does (true of torch's ``Linear``,
    ``Conv*``, ``BatchNorm*``, ``LayerNorm``, ``Embedding``, ...), modules are constructed in the
    order ``model.modules()`` lists them (the order they are assigned in), and nothing else draws
    from torch's generator between the seed and this call. A table is part of that stream in the
    eager build (its weight is drawn N(0, 1)) but not here, so layers constructed after a swapped
    table get other values than eagerly; construct the tables last to keep every dense value. Init
    code of the model's own (``nn.init.xavier_uniform_(self.fc.weight)`` in ``__init__``) does
    nothing on the meta device and is not replayed.

    ``ConfigError``, before any module is reset, when a module holding a meta tensor has no
    ``reset_parameters()``; and after, when a ``reset_parameters()`` left a floating tensor unset
    (materialised tensors start as NaN, so what no rule wrote is found).
    """
    owners = [(n, m) for n, m in model.named_modules() if any(t.is_meta for _, t in _own_tensors(m))]
    orphans = [n or "<model>" for n, m in owners if not callable(getattr(m, "reset_parameters", None))]
    if orphans:
        raise ConfigError(
            f"{SECTION}: the model was built on the meta device, and module(s) {orphans} hold parameters or "
            "buffers there but have no reset_parameters() to initialise them once the tables are in the "
            "store. Give them a reset_parameters(), or build those layers on a real device (only the "
            "tables need the meta device)."
        )
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for _, module in owners:
        for holder in (module._parameters, module._buffers):
            for key, old in holder.items():
                if old is not None and old.is_meta:
                    if id(old) not in made:
                        made[id(old)] = (old, _unset_like(old, device))
                    holder[key] = made[id(old)][1]
    fresh = {id(new) for _, new in made.values()}
    with torch.no_grad():
        for _, module in owners:
            kept = {key: t.clone() for key, t in _own_tensors(module) if id(t) not in fresh}
            module.reset_parameters()
            for key, t in _own_tensors(module):
                if key in kept:  # not on the meta device: its values stay
                    t.copy_(kept[key])
    unset = [
        f"{name}.{key}" if name else key
        for name, module in owners
        for key, t in _own_tensors(module)
        if id(t) in fresh and t.is_floating_point() and bool(torch.isnan(t).any())
    ]
    if unset:
        raise ConfigError(
            f"{SECTION}: the model was built on the meta device, and reset_parameters() left {unset} unset "
            "(NaN where no initial value was written). Make reset_parameters() initialise every parameter "
            "and buffer of its module, or build that layer on a real device."
        )
    return made


def _unset_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor like meta ``t`` on ``device``: NaN (floating) or 0, a Parameter if ``t`` is one."""
    out = torch.empty_like(t, device=device)
    if out.is_floating_point() or out.is_complex():
        out.fill_(math.nan)
    else:
        out.zero_()
    return nn.Parameter(out, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else out


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's own parameters and buffers (not its children's), by attribute name."""
    return [(k, t) for h in (module._parameters, module._buffers) for k, t in h.items() if t is not None]
