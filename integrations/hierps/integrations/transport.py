"""Transports for the sharded store's collectives: torch.distributed and Horovod.

Both turn a failed or timed-out collective (a rank died, the network broke) into
:class:`hierps.errors.PeerLostError`, so a surviving rank exits with a message instead of hanging.
The store's collectives run on the job's process group, and wait for a peer that is alive but silent
as long as its timeout says (``init_process_group(timeout=...)``, default 30 minutes, or
``deepspeed.init_distributed(timeout=...)``, default 10, which ``hierps.deepspeed.initialize`` calls
where no group exists): a rank that dies is seen at once, as its connections close.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hierps.errors import ConfigError, PeerLostError
from hierps.integrations.horovod import launched_by_horovodrun

__all__ = ["HorovodTransport", "TorchDistributedTransport", "default_transport", "launched_by_horovodrun"]

T = TypeVar("T")


def _guard(rank: int, what: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except PeerLostError:
        raise
    except (RuntimeError, ValueError, OSError) as exc:
        raise PeerLostError(
            f"rank {rank}: {what} with the other ranks failed ({str(exc).splitlines()[0][:300]}). A peer rank "
            "died or stopped answering; this job cannot continue. Restart it; the store reopens at its "
            "last checkpoint."
        ) from exc


class TorchDistributedTransport:
    """Collectives over the default torch.distributed process group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "torch.distributed is not initialised: call deepspeed.init_distributed() or "
                "torch.distributed.init_process_group() before building a sharded store."
            )
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )

    def companion(self) -> TorchDistributedTransport:
        """A second process group over the same ranks, for collectives on another thread (collective:
        every rank calls it, in the same order)."""
        group = _guard(
            self.rank,
            "creating a process group",
            lambda: self._dist.new_group(
                ranks=list(range(self.world_size)), backend=self._dist.get_backend(self.group)
            ),
        )
        return TorchDistributedTransport(group)

    def all_to_all(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        counts = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
        recv = torch.empty_like(counts)
        _guard(
            self.rank,
            "exchanging all-to-all sizes",
            lambda: self._dist.all_to_all_single(recv, counts, group=self.group),
        )
        recv_counts = recv.tolist()
        return self.all_to_all_known(send, send_counts, recv_counts), recv_counts

    def all_to_all_known(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        send = send.detach().to(self.device).contiguous()
        out = torch.empty((sum(recv_counts), *send.shape[1:]), dtype=send.dtype, device=self.device)
        _guard(
            self.rank,
            "an all-to-all of rows",
            lambda: self._dist.all_to_all_single(out, send, recv_counts, send_counts, group=self.group),
        )
        return out

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        out = t.to(self.device).clone()
        _guard(self.rank, "an all-reduce", lambda: self._dist.all_reduce(out, group=self.group))
        return out.to(t.device)

    def barrier(self) -> None:
        flag = torch.zeros(1, device=self.device)
        self.all_reduce_sum(flag)  # a barrier that times out like every other collective


class HorovodTransport:
    """Collectives over Horovod (``hvd.alltoall`` with int32 splits, ``hvd.allreduce``)."""

    def __init__(self, prefix: str = "hierps") -> None:
        try:
            import horovod.torch as hvd
        except ImportError as exc:
            raise ConfigError(
                "dense_allreduce 'horovod' needs Horovod: run `make horovod` (builds and caches "
                "Horovod 0.28.1 for this torch)."
            ) from exc
        if not hvd.is_initialized():
            hvd.init()
        self._hvd = hvd
        self.rank = hvd.rank()
        self.world_size = hvd.size()
        self._prefix = prefix
        self._n = 0

    def companion(self) -> HorovodTransport:
        """Collectives under other names, for another thread (each rank makes it at the same point)."""
        return HorovodTransport(prefix=f"{self._prefix}.companion")

    def _name(self, what: str) -> str:
        self._n += 1
        return f"{self._prefix}.{what}.{self._n}"

    def all_to_all(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        splits = torch.tensor(send_counts, dtype=torch.int32)
        out, recv_splits = _guard(
            self.rank,
            "an all-to-all of rows",
            lambda: self._hvd.alltoall(
                send.detach().cpu().contiguous(), splits=splits, name=self._name("alltoall")
            ),
        )
        return out, [int(x) for x in recv_splits.tolist()]

    def all_to_all_known(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        return self.all_to_all(send, send_counts)[0]

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return _guard(
            self.rank,
            "an all-reduce",
            lambda: self._hvd.allreduce(t.cpu(), op=self._hvd.Sum, name=self._name("allreduce")),
        ).to(t.device)

    def barrier(self) -> None:
        self.all_reduce_sum(torch.zeros(1))

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Average the dense gradients of ``params`` over ranks in one grouped all-reduce."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        reduced = _guard(
            self.rank,
            "the dense gradient all-reduce",
            lambda: self._hvd.grouped_allreduce(
                [g.detach().cpu() for g in grads], op=self._hvd.Average, name=self._name("dense")
            ),
        )
        for g, r in zip(grads, reduced):
            g.copy_(r.to(g.device))


def default_transport(kind: str = "auto") -> TorchDistributedTransport | HorovodTransport:
    """``"horovod"``, ``"torch"`` / ``"deepspeed"``, or ``"auto"`` (Horovod under horovodrun)."""
    if kind == "horovod" or (kind == "auto" and launched_by_horovodrun()):
        return HorovodTransport()
    return TorchDistributedTransport()
