"""Pass-aware data loading: read passes of mini-batches ahead and load their rows before they run.

The paper trains in passes: the distinct ids of the next ``pass_batches`` mini-batches (the
working set) are pulled from RAM / SSD into the device tier in one sorted batch, then the
mini-batches run against the device tier alone, while the next pass's rows are read in the
background. :class:`PassLoader` wraps any iterable of batches (a ``DataLoader``, DeepSpeed's
loader, a list) to do exactly that::

    loader = PassLoader(train_loader, lambda b: {"user": b["user_ids"]}, engine)
    for batch in loader:          # begin_pass(these 16 batches) happened before the first,
        loss = engine(batch)      # prefetch(the next 16) right after it;
        engine.backward(loss)     # end_pass() happens once the 16th batch was trained on
        engine.step()

Without it, training is still correct: rows are fetched on demand, one mini-batch at a time.

Where a module's ids are in a batch is said by a function, by ``{module: key}`` (``batch[key]``;
a :class:`BatchIds` spec reaches deeper: a path of keys, and a column range of a 2-D tensor,
cast to int64 as models do with ``X[:, 3:4].long()``), or found by the loader itself: given an
engine and no ids, it yields the first batches as they are, watches the ids each swapped module
receives in their training forward, and looks for the one place in the batch that holds exactly
those ids (:func:`infer_batch_ids`). From then on it loads passes; the store checks each
mini-batch's ids against the announced ones, so a wrong guess costs speed, never correctness.
"""

from __future__ import annotations

import copy
import itertools
import logging
import multiprocessing
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hierps._position import DataPositionWarning, StatefulSource
from hierps._store import Store
from hierps.errors import ConfigError, StoreClosedError
from hierps.interface import Bags
from hierps.sharding._sharded import ShardedStore

__all__ = ["BatchIds", "PassLoader", "infer_batch_ids", "parse_batch_ids"]

_log = logging.getLogger("hierps.loader")
_INFER_BATCHES = 3  # batches watched at most before the ids' places must be unique

IdsFn = Callable[[Any], Mapping[str, Any]]
_DEFAULT_PASS_BATCHES = 16
_STATE_FORMAT = 1


class PassLoader:
    """Yields the batches of ``loader`` unchanged, loading each pass's rows into the device tier first.

    Args:
        loader: any iterable of batches; it is iterated once per ``iter(PassLoader)``.
        ids: ``batch -> {module_name: ids}`` (ids: any-shape int64 tensor / array of the batch's
            feature ids for that module's table), or a mapping ``{module_name: key}`` read as
            ``batch[key]`` (dict batches with str keys, tuple batches with int keys), or None to
            use the ``batch_ids`` mapping of the engine's ``hierarchical_ps`` section.
        target: the :class:`hierps.Store` (or :class:`hierps.ShardedStore`: then every rank iterates
            its own loader, with as many batches), or an engine from ``hierps.deepspeed.initialize``.
        pass_batches: mini-batches per pass; default the section's ``pass_batches`` (16 for a store).
        evaluate: the batches are evaluated, not trained: no pass is begun; the rows of each group of
            ``pass_batches`` batches are read ahead (``store.read_ahead``) while the group before
            it runs, for forwards under ``torch.no_grad()`` / ``model.eval()``.

    Each pass: ``store.begin_pass`` gets the ids of its ``pass_batches`` batches (one dict per
    batch, in order); the batches of the pass after it are read too and announced with
    ``store.prefetch`` (so their rows are read in the background while this pass trains; a
    store without ``prefetch`` skips that); the pass's batches are yielded one by one; and
    ``store.end_pass`` runs when the batch after them is asked for (so after the last one's
    optimizer step), or when iteration stops. At most ``2 * pass_batches`` batches are held. A pass
    whose rows exceed the device budget is loaded group by group, without read-ahead; the loader
    then halves its passes (down to one batch) until they load whole.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        ids: IdsFn | Mapping[str, Any] | None,
        target: Any,
        pass_batches: int | None = None,
        *,
        evaluate: bool = False,
    ) -> None:
        self.loader = loader
        self.evaluate = evaluate
        self.store = _store_of(target)
        section = getattr(target, "hierps_config", None)
        if pass_batches is None:
            pass_batches = section.pass_batches if section is not None else _DEFAULT_PASS_BATCHES
        if isinstance(pass_batches, bool) or not isinstance(pass_batches, int) or pass_batches < 1:
            raise ConfigError(f"pass_batches: expected an int >= 1. Got {pass_batches!r} instead.")
        self.pass_batches = pass_batches
        self.size = pass_batches  # batches of the next pass: fewer once a pass did not fit the device tier
        self.modules: dict[str, nn.Module] = dict(getattr(target, "hierps_modules", None) or {})
        if ids is None:
            ids = section.batch_ids if section is not None else None
            if ids is None and not self.modules:
                raise ConfigError(
                    "PassLoader: no ids given. Pass a function batch -> {module_name: ids}, a mapping "
                    '{module_name: batch key}, or set "batch_ids" in the hierarchical_ps section.'
                )
        self.ids_of: IdsFn | None = None  # None: found from the first batches (infer_batch_ids)
        if ids is not None:
            self.ids_of = ids if callable(ids) else _by_key(self._checked(parse_batch_ids(ids)))
        self.places: dict[str, Any] | None = None  # where infer_batch_ids found the ids, as JSON
        # The data position (see state_dict): the loader's state after the batch last yielded, and
        # how many batches of its pass are still to come.
        self._stateful = isinstance(loader, StatefulSource)
        self._streams = callable(getattr(loader, "last_of_pass", None))  # the loader cuts the passes
        self._position: Any = None
        self._pass_left = 0
        self._pass_open = False  # the batch last yielded is of a pass not yet ended
        self._resume_left: int | None = None  # resuming: batches of the open pass still to come
        if evaluate:
            return
        if self._stateful:
            self.store.track_data(self)
        elif isinstance(loader, torch.utils.data.DataLoader):
            warnings.warn(
                "PassLoader: a torch DataLoader has no state, so checkpoints cannot hold the position in its data "
                "and a resumed run starts its epoch over. Use torchdata.stateful_dataloader.StatefulDataLoader "
                "(the same arguments) to resume at the batch after the last one trained.",
                DataPositionWarning,
                stacklevel=2,
            )

    def _checked(self, places: dict[str, BatchIds]) -> dict[str, BatchIds]:
        """``batch_ids`` naming only modules the engine swapped (when the loader has an engine)."""
        unknown = sorted(set(places) - set(self.modules)) if self.modules else []
        if unknown:
            raise ConfigError(
                f"batch_ids: {unknown[0]!r} is not a module the store trains; its modules are "
                f"{sorted(self.modules)}. Map each of them to where its ids are in a batch."
            )
        return places

    @property
    def at_pass_end(self) -> bool:
        """Whether the batch last yielded is the last of its pass (its ``end_pass`` runs when the next
        batch is asked for): where a loop that checkpoints or publishes every few passes does so."""
        return self._pass_open and self._pass_left == 0

    def state_dict(self) -> dict[str, Any]:
        """Where the data is: the wrapped loader's state after the batch last yielded (not after
        the batches read ahead), the batches of that batch's pass still to come, the pass size and
        the ids' places found from the first batches. Saved with each checkpoint of the store (the
        loader tracks itself, :meth:`hierps.Store.track_data`), given back when the store opens or
        restores a checkpoint; needs a loader with ``state_dict`` (torchdata's StatefulDataLoader)."""
        if not self._stateful:
            raise ConfigError(
                f"PassLoader.state_dict: the wrapped {type(self.loader).__name__} has no state_dict(); use "
                "torchdata.stateful_dataloader.StatefulDataLoader to save the data position."
            )
        inner = self._position if self._position is not None else self.loader.state_dict()  # type: ignore[attr-defined]
        return {
            "format": _STATE_FORMAT,
            "loader": inner,
            "pass_left": self._pass_left,
            "pass_open": self._pass_open,
            "pass_batches": self.size,
            "places": self.places,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state`` (:meth:`state_dict`): the next ``iter(loader)`` yields the batch after
        the last one trained, the rest of its pass as one pass, then the passes that followed."""
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise ConfigError(
                f"PassLoader.load_state_dict: expected a state of PassLoader.state_dict() (format "
                f"{_STATE_FORMAT}). Got {str(state)[:120]}."
            )
        if not self._stateful:
            raise ConfigError(
                f"PassLoader.load_state_dict: the wrapped {type(self.loader).__name__} has no load_state_dict(); "
                "use torchdata.stateful_dataloader.StatefulDataLoader."
            )
        self.loader.load_state_dict(state["loader"])  # type: ignore[attr-defined]
        self._position = copy.deepcopy(state["loader"])
        self._pass_left = int(state["pass_left"])
        self._pass_open = bool(state["pass_open"])
        self._resume_left = self._pass_left if self._pass_open else None
        self.size = int(state["pass_batches"])
        places = state.get("places")
        if places is not None and self.ids_of is None:
            self.places = places
            self.ids_of = _by_key(parse_batch_ids(places["ids"]), parse_batch_ids(places["offsets"]))

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # What else the wrapped loader offers (DeepSpeed's loader: data_sampler, ...) stays reachable.
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        if self._stateful and self._position is None:  # the epoch's start, before anything is read ahead
            self._position = copy.deepcopy(self.loader.state_dict())  # type: ignore[attr-defined]
        resume_left, self._resume_left = self._resume_left, None
        if _forks_workers(self.loader):  # iter() forks them: not while the store's threads are mid-task
            self.store._settle_for_fork()
        # One iterator for the whole epoch, even over a loader whose __iter__ starts it again (DeepSpeed's).
        batches = _Tracked(iter(self.loader), self.loader, self._stateful, self._streams)
        if self.ids_of is None:
            yield from self._infer(batches)
            if self.ids_of is None:  # not found: the rest runs on demand
                for batch in batches:
                    self._yielded(batches, None)
                    yield batch
                self._position = None
                return
        if self.evaluate:
            yield from self._evaluated(batches)
            return
        prefetch = getattr(self.store, "prefetch", None)
        if resume_left == 0:  # the checkpoint came after its pass's last batch, before the pass ended
            self.store.begin_pass([])
            self.store.end_pass()
        group = self._read(batches, None if self._streams else resume_left or None)
        in_pass = False
        try:
            while group:
                self.store.begin_pass(_ids(group))
                in_pass = True
                if getattr(self.store, "pass_groups", 1) > 1 and not self._streams:
                    # The pass did not fit the device tier (it loads group by group, nothing read ahead
                    # or translated): make the next ones smaller until they load whole.
                    self.size = max(1, self.size // 2)
                # A stream's next pass is read once this one ended: reading it ahead would hold this
                # pass back until the next one's logs are all in.
                upcoming = self._read(batches) if not self._streams else []
                if upcoming and prefetch is not None:
                    prefetch(_ids(upcoming))
                for i, (batch, _) in enumerate(group):
                    self._yielded(batches, len(group) - i - 1)
                    yield batch
                in_pass = False
                self.store.end_pass()
                group = upcoming if not self._streams else self._read(batches)
            self._position, self._pass_left, self._pass_open = (
                None,
                0,
                False,
            )  # the epoch ended: the loader's own state says so
        finally:
            if in_pass:  # the consumer stopped mid-pass: close the pass all the same
                try:
                    self.store.end_pass()
                except StoreClosedError:
                    pass

    def _yielded(self, batches: _Tracked, pass_left: int | None) -> None:
        """The next batch pulled from ``batches`` is being yielded: the position is after it, with
        ``pass_left`` batches of its pass to come (None: the batch is of no pass)."""
        if batches.states:
            self._position = batches.states.popleft()
        self._pass_left, self._pass_open = pass_left or 0, pass_left is not None

    def _evaluated(self, batches: _Tracked) -> Iterator[Any]:
        """Evaluation: each group's rows read ahead while the group before it runs; no pass."""
        read_ahead = getattr(self.store, "read_ahead", None)
        group = self._read(batches)
        if group and read_ahead is not None:
            read_ahead(_ids(group))
        while group:
            upcoming = self._read(batches)
            if upcoming and read_ahead is not None:
                read_ahead(_ids(upcoming))
            for batch, _ in group:
                yield batch
            group = upcoming

    def _read(self, batches: _Tracked, size: int | None = None) -> list[tuple[Any, Mapping[str, Any]]]:
        """The next pass's batches, each with its ids: ``size`` (default: the pass size) or fewer at the
        end; from a loader that cuts passes (``last_of_pass()``), up to the last batch of its pass."""
        ids_of = self.ids_of
        assert ids_of is not None
        if self._streams and size is None:
            group = []
            for b in batches:
                group.append((b, ids_of(b)))
                if batches.last_of_pass:
                    break
            return group
        return [(b, ids_of(b)) for b in itertools.islice(batches, size or self.size)]

    def _infer(self, batches: _Tracked) -> Iterator[Any]:
        """Yield up to ``_INFER_BATCHES`` batches unchanged (rows fetched on demand), watching the ids
        the swapped modules get, until each module's ids have one place in the batch."""
        seen: dict[str, list[torch.Tensor]] = {}
        seen_offsets: dict[str, list[torch.Tensor]] = {}
        found: dict[str, list[BatchIds]] | None = None
        bags: dict[str, list[BatchIds]] | None = None  # where pooled modules' offsets are
        hooks = [
            m.register_forward_pre_hook(_Recorder(name, seen, seen_offsets, self.evaluate))
            for name, m in self.modules.items()
        ]
        try:
            for _ in range(_INFER_BATCHES):
                batch = next(batches, _END)
                if batch is _END:
                    return
                seen.clear()
                seen_offsets.clear()
                self._yielded(batches, None)
                yield batch
                found = infer_batch_ids(batch, seen, found, names=self.modules)
                if bags is None or set(bags) == set(seen_offsets):
                    bags = infer_batch_ids(batch, seen_offsets, bags)
                if found is None or all(len(c) == 1 for c in found.values()):
                    break
        finally:
            for h in hooks:
                h.remove()
        if found is None or any(not c for c in found.values()):
            missing = sorted(n for n in self.modules if found is None or not found.get(n))
            warnings.warn(
                f"PassLoader: could not find where the ids of {missing} are in a batch (each module must "
                "be called once per training batch with ids that are a tensor of the batch, or a column "
                'range of one); batches run without passes, rows fetched on demand. Set "batch_ids" in the '
                "hierarchical_ps section, or give PassLoader a function batch -> {module: ids}.",
                stacklevel=2,
            )
            return
        chosen = {name: c[0] for name, c in found.items()}
        offsets = {name: c[0] for name, c in (bags or {}).items() if c and name in chosen}
        _log.info(
            "PassLoader: batch_ids found from the first batches: %s; offsets of the bags: %s",
            {n: b.to_json() for n, b in chosen.items()},
            {n: b.to_json() for n, b in offsets.items()},
        )
        self.ids_of = _by_key(chosen, offsets)
        self.places = {
            "ids": {n: b.to_json() for n, b in chosen.items()},
            "offsets": {n: b.to_json() for n, b in offsets.items()},
        }


def _ids(group: list[tuple[Any, Mapping[str, Any]]]) -> list[Mapping[str, Any]]:
    """The ids of each batch of ``group`` (as ``PassLoader._read`` pairs them), as a store takes them."""
    return [ids for _, ids in group]


class _Tracked:
    """The batches of one epoch, with the loader's state after each (``states``, in the order pulled,
    until :meth:`PassLoader._yielded` takes them) and whether the last one pulled ends its pass."""

    def __init__(self, batches: Iterator[Any], loader: Any, stateful: bool, streams: bool) -> None:
        self.batches, self.loader, self.stateful, self.streams = batches, loader, stateful, streams
        self.states: deque[Any] = deque()
        self.last_of_pass = False

    def __iter__(self) -> _Tracked:
        return self

    def __next__(self) -> Any:
        batch = next(self.batches)
        if self.stateful:
            self.states.append(copy.deepcopy(self.loader.state_dict()))
        if self.streams:
            self.last_of_pass = bool(self.loader.last_of_pass())
        return batch


def _forks_workers(loader: Any) -> bool:
    """Whether ``iter(loader)`` starts worker processes with ``fork``: a torch DataLoader (or
    torchdata's) with workers that are not kept across epochs, or DeepSpeed's loader (which builds
    one at every ``iter()``), where the platform's start method is fork."""
    workers = getattr(loader, "num_workers", None)
    if workers is None:
        workers = getattr(loader, "num_local_io_workers", 0)  # DeepSpeedDataLoader
    if not isinstance(workers, int) or workers <= 0:
        return False
    if getattr(loader, "persistent_workers", False) and getattr(loader, "_iterator", None) is not None:
        return False  # started once, kept
    context = getattr(loader, "multiprocessing_context", None)
    if context is None:
        method = (
            multiprocessing.get_start_method(allow_none=True)
            or multiprocessing.get_context().get_start_method()
        )
    else:
        method = context if isinstance(context, str) else context.get_start_method()
    return method == "fork"


def _store_of(target: Any) -> Store | ShardedStore:
    if isinstance(target, (Store, ShardedStore)):
        return target
    store = getattr(target, "hierps_store", None)
    if isinstance(store, (Store, ShardedStore)):
        return store
    raise ConfigError(
        f"PassLoader: expected a hierps.Store or an engine from hierps.deepspeed.initialize (with "
        f"hierps_store). Got {type(target).__name__}; was the hierarchical_ps section enabled?"
    )


def _by_key(mapping: Mapping[str, BatchIds], offsets: Mapping[str, BatchIds] | None = None) -> IdsFn:
    """``{module: BatchIds}`` -> ``batch -> {module: ids}``, with an error naming a missing key;
    a module with a place in ``offsets`` gets ``hierps.Bags(ids, its offsets)``."""
    bags = dict(offsets or {})

    def ids_of(batch: Any) -> dict[str, Any]:
        out = {}
        for module, where in mapping.items():
            try:
                out[module] = where(batch)
                if module in bags:
                    out[module] = Bags(out[module], bags[module](batch))
            except (KeyError, IndexError, TypeError):
                raise ConfigError(
                    f"batch_ids: module {module!r} reads batch{where.describe()}, which this batch does not "
                    f"have (a {type(batch).__name__}). Map each module to a key of the batch: a dict's key "
                    'or a tuple\'s index, then {"path": [...], "columns": [a, b]} for columns of a tensor.'
                ) from None
        return out

    return ids_of


_END = object()
Key = str | int


@dataclass(frozen=True)
class BatchIds:
    """Where a module's ids are in a batch: ``batch[path[0]][path[1]]...``, then columns ``[a, b)`` of
    that 2-D tensor when ``columns`` is set; cast to int64 (models index with ``X[:, a:b].long()``).

    In the config: ``"user_ids"`` or ``0`` (one key), ``[0, "user"]`` (a path), or
    ``{"path": [0], "columns": [3, 4]}``.
    """

    path: tuple[Key, ...]
    columns: tuple[int, int] | None = None

    def __call__(self, batch: Any) -> Any:
        """The ids at this place of ``batch``; ``KeyError`` / ``IndexError`` / ``TypeError`` where the
        batch has no such place (a key of the path indexes a mapping, a list or a tuple, never a
        tensor: ``batch[5]`` of a tensor batch would be its sixth row, not ids)."""
        leaf = batch
        for key in self.path:
            if not isinstance(leaf, (Mapping, list, tuple)):
                raise TypeError(f"a {type(leaf).__name__} is not indexed by a key of batch_ids")
            node: Any = leaf  # a str key of a list raises TypeError, as the caller expects
            leaf = node[key]
        if self.columns is not None:
            leaf = leaf[:, self.columns[0] : self.columns[1]]
        if isinstance(leaf, torch.Tensor) and leaf.dtype.is_floating_point:
            leaf = leaf.long()
        return leaf

    def describe(self) -> str:
        cols = f"[:, {self.columns[0]}:{self.columns[1]}]" if self.columns is not None else ""
        return "".join(f"[{k!r}]" for k in self.path) + cols

    def to_json(self) -> Any:
        if self.columns is not None:
            return {"path": list(self.path), "columns": list(self.columns)}
        return self.path[0] if len(self.path) == 1 else list(self.path)


def parse_batch_ids(mapping: Mapping[str, Any]) -> dict[str, BatchIds]:
    """``{module: key | path | {"path", "columns"} | BatchIds}`` -> ``{module: BatchIds}``; ``ConfigError`` naming a bad one."""
    return {module: _parse_one(module, spec) for module, spec in mapping.items()}


def _parse_one(module: str, spec: Any) -> BatchIds:
    if isinstance(spec, BatchIds):
        return spec
    path, columns = spec, None
    if isinstance(spec, Mapping) and set(spec) <= {"path", "columns"} and "path" in spec:
        path, columns = spec["path"], spec.get("columns")
    if not isinstance(path, (list, tuple)):
        path = [path]
    good_path = bool(path) and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in path)
    good_cols = columns is None or (
        isinstance(columns, (list, tuple))
        and len(columns) == 2
        and all(isinstance(c, int) and not isinstance(c, bool) for c in columns)
        and 0 <= columns[0] < columns[1]
    )
    if not (good_path and good_cols):
        raise ConfigError(
            f'batch_ids.{module}: expected a batch key ("user_ids", 0), a path of keys ([0, "user"]), or '
            f'{{"path": [0], "columns": [3, 4]}} for columns 3..3 of a 2-D tensor. Got {spec!r} instead.'
        )
    return BatchIds(tuple(path), tuple(columns) if columns is not None else None)


class _Recorder:
    """Forward pre-hook: the ids a module gets in each training forward (each forward, evaluating)."""

    def __init__(
        self,
        name: str,
        seen: dict[str, list[torch.Tensor]],
        offsets: dict[str, list[torch.Tensor]],
        evaluating: bool = False,
    ) -> None:
        self.name, self.seen, self.offsets, self.evaluating = name, seen, offsets, evaluating

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        training = module.training and torch.is_grad_enabled()
        if (training or self.evaluating) and args and isinstance(args[0], torch.Tensor):
            self.seen.setdefault(self.name, []).append(args[0].detach().reshape(-1).cpu())
            if len(args) > 1 and isinstance(args[1], torch.Tensor) and args[0].dim() == 1:
                self.offsets.setdefault(self.name, []).append(args[1].detach().reshape(-1).cpu())


def infer_batch_ids(
    batch: Any,
    seen: Mapping[str, list[torch.Tensor]],
    candidates: dict[str, list[BatchIds]] | None = None,
    names: Iterable[str] | None = None,
) -> dict[str, list[BatchIds]] | None:
    """The places in ``batch`` that hold exactly the ids each module got (``seen``: module -> ids of
    each call), narrowed down from ``candidates`` (the places found on earlier batches).

    A place is a tensor at most two keys deep (dict keys, tuple / list indexes), whole or a range of
    columns of a 2-D one, cast to int64. ``names``: the modules to place (default: those in
    ``seen``). None when one of them did not run exactly once in the batch.
    """
    out: dict[str, list[BatchIds]] = {}
    for name in list(names) if names is not None else list(seen):
        calls = seen.get(name, [])
        if len(calls) != 1:
            return None
        ids = calls[0]
        pool = candidates[name] if candidates is not None else list(_places(batch, ids))
        out[name] = [p for p in pool if _holds(p, batch, ids)]
    return out


def _leaves(
    batch: Any, path: tuple[Key, ...] = (), depth: int = 2
) -> Iterator[tuple[tuple[Key, ...], torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif depth and isinstance(batch, Mapping):
        for k, v in batch.items():
            if isinstance(k, str):
                yield from _leaves(v, (*path, k), depth - 1)
    elif depth and isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            yield from _leaves(v, (*path, i), depth - 1)


def _places(batch: Any, ids: torch.Tensor) -> Iterator[BatchIds]:
    """Every place in ``batch`` of as many values as ``ids``: whole tensors, column ranges of 2-D ones."""
    n = ids.numel()
    for path, leaf in _leaves(batch):
        if leaf.is_floating_point() or leaf.dtype in (
            torch.int64,
            torch.int32,
            torch.int16,
            torch.uint8,
            torch.int8,
        ):
            if leaf.numel() == n:
                yield BatchIds(path)
            if leaf.dim() == 2 and leaf.shape[0] and n % leaf.shape[0] == 0:
                width = n // leaf.shape[0]
                for a in range(0, leaf.shape[1] - width + 1) if 0 < width < leaf.shape[1] else ():
                    yield BatchIds(path, (a, a + width))


def _holds(place: BatchIds, batch: Any, ids: torch.Tensor) -> bool:
    try:
        got = place(batch)
    except (KeyError, IndexError, TypeError):
        return False
    if not isinstance(got, torch.Tensor) or got.numel() != ids.numel():
        return False
    return bool(torch.equal(got.detach().reshape(-1).cpu().to(torch.int64), ids.to(torch.int64)))
