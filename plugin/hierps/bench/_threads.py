"""Several ranks of a sharded store in one process: one thread per rank, collectives through memory
(the tests' worlds of 2 or 3 ranks, and ``hierps bench --scale``'s reshard phase).

:class:`ThreadTransport` implements :class:`hierps.sharding.Transport` for W threads: each
collective hands every rank's contribution to the others through a shared slot list and a barrier,
so that sharded behaviour at world size 2 or 3 is tested in milliseconds, against one
``hierps.Store`` trained on the global batches. Sums are taken in rank order on every rank, as a
real all-reduce gives every rank the same result. :func:`run_ranks` runs one function per rank
and returns their results (re-raising the first failure, after breaking the others' waits).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["ThreadTransport", "one_rank", "run_ranks"]

T = TypeVar("T")


class _Group:
    def __init__(self, world_size: int, timeout: float | None = 120.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list[Any] = [None] * world_size


class ThreadTransport:
    """One rank's end of a :class:`_Group` (see the module docstring)."""

    def __init__(self, group: _Group, rank: int) -> None:
        self._group = group
        self.rank = rank
        self.world_size = group.world_size

    def _all_gather(self, item: Any) -> list[Any]:
        g = self._group
        g.slots[self.rank] = item
        g.barrier.wait()
        out = list(g.slots)
        g.barrier.wait()  # nobody writes the next round's slot before everyone read this one
        return out

    def all_to_all(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        assert len(send_counts) == self.world_size and sum(send_counts) == send.shape[0]
        parts = self._all_gather(list(send.detach().split(send_counts)))
        mine = [parts[src][self.rank].clone() for src in range(self.world_size)]
        return torch.cat(mine), [p.shape[0] for p in mine]

    def all_to_all_known(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        out, counts = self.all_to_all(send, send_counts)
        assert counts == recv_counts, (counts, recv_counts)
        return out

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._all_gather(t.detach().clone())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total

    def barrier(self) -> None:
        self._all_gather(None)

    def companion(self) -> ThreadTransport:
        """A second channel over the same ranks, for collectives on another thread (collective)."""
        group = self._all_gather(_Group(self.world_size, self._group.timeout) if self.rank == 0 else None)[0]
        return ThreadTransport(group, self.rank)


def one_rank() -> ThreadTransport:
    """The transport of a process that is the only rank (a sharded store then needs no collective)."""
    return ThreadTransport(_Group(1, None), 0)


def run_ranks(world_size: int, fn: Callable[[ThreadTransport], T], timeout: float | None = 120.0) -> list[T]:
    """Run ``fn(transport)`` on ``world_size`` threads, one rank each -> their results in rank order
    (a rank waiting ``timeout`` seconds for the others in a collective fails; None: no limit)."""
    group = _Group(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def rank_main(rank: int) -> None:
        try:
            results[rank] = fn(ThreadTransport(group, rank))
        except BaseException as exc:  # re-raised below, after the other ranks stop waiting
            errors[rank] = exc
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next(
        (e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None
    )
    if first is None:
        first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
