"""What the sharded machinery drives in each rank's own store, below the user's API.

A rank's :class:`hierps.Store` holds the rows the rank owns. :class:`hierps.ShardedStore` calls its
public methods for what a user could call too, and reaches the parts behind it (the tiers, the
owner's side of a pass: resident slots, sightings, slot gradients) only through :class:`OwnerParts`,
taken once from the store with :func:`hierps._store.store_parts`.
"""

from __future__ import annotations

from typing import Protocol

from hierps._core import StoreCore
from hierps._rows import RowAccess
from hierps.lifecycle._lifecycle import FeatureLifeCycle
from hierps.training._passes import PassRunner
from hierps.training._trainer import SparseTrainer

__all__ = ["OwnerParts"]


class OwnerParts(Protocol):
    """The parts of a rank's store that sharding drives directly."""

    @property
    def core(self) -> StoreCore:
        """The tiers, the tables' pending keys and the checkpoint catalog."""
        ...

    @property
    def passes(self) -> PassRunner:
        """Resident slots of owned keys, loaded on demand; parsing a pass's batches."""
        ...

    @property
    def trainer(self) -> SparseTrainer:
        """Sightings and gradients applied by slot; rows served to other ranks."""
        ...

    @property
    def life(self) -> FeatureLifeCycle:
        """Counters added for keys other ranks saw."""
        ...

    @property
    def rows(self) -> RowAccess:
        """Forgetting a table's rows before a reshard writes them anew."""
        ...
