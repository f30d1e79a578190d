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
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from hierps._store import Store
from hierps.errors import ConfigError, StoreClosedError
from hierps.sharding._sharded import ShardedStore

__all__ = ["PassLoader"]

IdsFn = Callable[[Any], Mapping[str, Any]]
_DEFAULT_PASS_BATCHES = 16


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

    Each pass: ``store.begin_pass`` gets the ids of its ``pass_batches`` batches (one dict per
    batch, in order); the batches of the pass after it are read too and announced with
    ``store.prefetch`` (so their rows are read in the background while this pass trains; a
    store without ``prefetch`` skips that); the pass's batches are yielded one by one; and
    ``store.end_pass`` runs when the batch after them is asked for (so after the last one's
    optimizer step), or when iteration stops. At most ``2 * pass_batches`` batches are held.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        ids: IdsFn | Mapping[str, Any] | None,
        target: Any,
        pass_batches: int | None = None,
    ) -> None:
        self.loader = loader
        self.store = _store_of(target)
        section = getattr(target, "hierps_config", None)
        if pass_batches is None:
            pass_batches = section.pass_batches if section is not None else _DEFAULT_PASS_BATCHES
        if isinstance(pass_batches, bool) or not isinstance(pass_batches, int) or pass_batches < 1:
            raise ConfigError(f"pass_batches: expected an int >= 1. Got {pass_batches!r} instead.")
        self.pass_batches = pass_batches
        if ids is None:
            ids = section.batch_ids if section is not None else None
            if ids is None:
                raise ConfigError(
                    "PassLoader: no ids given. Pass a function batch -> {module_name: ids}, a mapping "
                    '{module_name: batch key}, or set "batch_ids" in the hierarchical_ps section.'
                )
        self.ids_of: IdsFn = ids if callable(ids) else _by_key(dict(ids))

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.loader)
        prefetch = getattr(self.store, "prefetch", None)
        group = self._read(batches)
        in_pass = False
        try:
            while group:
                self.store.begin_pass([ids for _, ids in group])
                in_pass = True
                upcoming = self._read(batches)
                if upcoming and prefetch is not None:
                    prefetch([ids for _, ids in upcoming])
                for batch, _ in group:
                    yield batch
                in_pass = False
                self.store.end_pass()
                group = upcoming
        finally:
            if in_pass:  # the consumer stopped mid-pass: close the pass all the same
                try:
                    self.store.end_pass()
                except StoreClosedError:
                    pass

    def _read(self, batches: Iterator[Any]) -> list[tuple[Any, Mapping[str, Any]]]:
        """The next ``pass_batches`` batches (fewer at the end), each with its ids."""
        return [(b, self.ids_of(b)) for b in itertools.islice(batches, self.pass_batches)]


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


def _by_key(mapping: dict[str, Any]) -> IdsFn:
    """``{module: key}`` -> ``batch -> {module: batch[key]}``, with an error naming a missing key."""

    def ids_of(batch: Any) -> dict[str, Any]:
        out = {}
        for module, key in mapping.items():
            try:
                out[module] = batch[key]
            except (KeyError, IndexError, TypeError):
                raise ConfigError(
                    f"batch_ids: module {module!r} reads batch[{key!r}], which this batch does not have "
                    f"(a {type(batch).__name__}). Map each module to a key of the batch."
                ) from None
        return out

    return ids_of
