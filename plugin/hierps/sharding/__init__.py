"""Many workers: each key has one owner rank; rows and gradients travel by all-to-all.

:class:`ShardedStore` has the semantics of one :class:`hierps.Store` over the global batch (W ranks
on slices of a batch equal one rank on the whole of it); :class:`Transport` is what it needs of a
collective library (torch.distributed or Horovod, in :mod:`hierps.integrations.transport`).
"""

from hierps.sharding._commits import streamed_reshards
from hierps.sharding._sharded import ShardedStore, Transport, owner_of, rank_dir

__all__ = ["ShardedStore", "Transport", "owner_of", "rank_dir", "streamed_reshards"]
