"""Horovod glue: jobs launched by ``horovodrun`` get what DeepSpeed / torch.distributed expect.

horovodrun sets only ``HOROVOD_*`` variables. :func:`map_horovod_env` derives RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT from them (rank 0's address and a free port of its host
are agreed on through a Horovod broadcast), so ``deepspeed.init_distributed`` can follow.
"""

from __future__ import annotations

import os
import socket

import torch

from hierps.errors import ConfigError
from hierps.integrations.rendezvous import free_port

__all__ = ["launched_by_horovodrun", "map_horovod_env"]


def launched_by_horovodrun() -> bool:
    return "HOROVOD_RANK" in os.environ


def _host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def map_horovod_env() -> dict[str, str]:
    """Set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from Horovod's environment.

    Variables already set are kept. Returns the values in effect. A no-op outside horovodrun.
    """
    if not launched_by_horovodrun():
        return {}
    env = os.environ
    env.setdefault("RANK", env["HOROVOD_RANK"])
    env.setdefault("WORLD_SIZE", env["HOROVOD_SIZE"])
    env.setdefault("LOCAL_RANK", env.get("HOROVOD_LOCAL_RANK", "0"))
    env.setdefault("LOCAL_WORLD_SIZE", env.get("HOROVOD_LOCAL_SIZE", "1"))
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        try:
            import horovod.torch as hvd
        except ImportError as exc:
            raise ConfigError(
                "launched by horovodrun but Horovod does not import: run `make horovod`."
            ) from exc
        if not hvd.is_initialized():
            hvd.init()
        packed = torch.zeros(5, dtype=torch.int64)
        if hvd.rank() == 0:
            addr = "127.0.0.1" if int(env.get("HOROVOD_CROSS_SIZE", "1")) == 1 else _host_address()
            packed = torch.tensor([*map(int, addr.split(".")), free_port("")], dtype=torch.int64)
        packed = hvd.broadcast(packed, root_rank=0, name="hierps.master_address")
        env.setdefault("MASTER_ADDR", ".".join(str(int(x)) for x in packed[:4]))
        env.setdefault("MASTER_PORT", str(int(packed[4])))
    return {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
