"""DeepSpeed's loader of ``training_data``, with a position that checkpoints keep.

``deepspeed.initialize(..., training_data=dataset)`` returns a ``DeepSpeedDataLoader``, which builds
a plain ``torch.utils.data.DataLoader`` at every ``iter()``: it has no state, so a resumed run would
start its epoch over. :func:`resumable` makes that loader build torchdata's ``StatefulDataLoader``
instead, with the same dataset, sampler (DeepSpeed's ``DistributedSampler`` over the data-parallel
ranks), batch size, collate function, workers, pinning and ``drop_last``: the same batches, in the
same order, and a ``state_dict()`` / ``load_state_dict()`` of the position in the epoch (kept per
rank: each rank's sampler gives it its own share). The returned :class:`hierps.PassLoader` saves
that position with every checkpoint.
"""

from __future__ import annotations

import warnings
from typing import Any

from deepspeed.runtime.dataloader import DeepSpeedDataLoader

from hierps._position import DataPositionWarning
from hierps.errors import ConfigError

__all__ = ["ResumableDeepSpeedLoader", "resumable"]

_FORMAT = 1


def resumable(loader: Any) -> Any:
    """``loader`` (a ``DeepSpeedDataLoader``) made resumable in place (its class gains
    :class:`ResumableDeepSpeedLoader`); another loader, or one DeepSpeed's curriculum learning drives
    (its sampler has a state of its own, outside this), is returned as it is, with a warning."""
    if not isinstance(loader, DeepSpeedDataLoader) or loader.curriculum_learning_enabled:
        _cannot(
            f"a {type(loader).__name__}"
            + (" driven by curriculum learning" if isinstance(loader, DeepSpeedDataLoader) else "")
        )
        return loader
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: F401
    except ImportError:
        _cannot("DeepSpeed's loader, since torchdata is not installed (pip install torchdata)")
        return loader
    base = type(loader)
    loader.__class__ = type(f"Resumable{base.__name__}", (ResumableDeepSpeedLoader, base), {})
    loader.hierps_resume = None
    return loader


def _cannot(what: str) -> None:
    warnings.warn(
        f"hierps.deepspeed.initialize: the position in the training data cannot be saved with checkpoints for "
        f"{what}: a resumed run starts its epoch over.",
        DataPositionWarning,
        stacklevel=3,
    )


class ResumableDeepSpeedLoader:
    """What :func:`resumable` adds to a ``DeepSpeedDataLoader``'s class (which stays a base)."""

    hierps_resume: Any  # the state to resume at, loaded into the next epoch's StatefulDataLoader
    # The base's attributes read here (set by DeepSpeedDataLoader.__init__).
    dataset: Any
    batch_size: int
    pin_memory: bool
    data_sampler: Any
    num_local_io_workers: int
    dataloader_drop_last: bool
    collate_fn: Any

    def _create_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        options: dict[str, Any] = {"collate_fn": self.collate_fn} if self.collate_fn is not None else {}
        self.dataloader = StatefulDataLoader(
            self.dataset,
            batch_size=self.batch_size,
            pin_memory=self.pin_memory,
            sampler=self.data_sampler,
            num_workers=self.num_local_io_workers,
            drop_last=self.dataloader_drop_last,
            **options,
        )
        if self.hierps_resume is not None:
            self.dataloader.load_state_dict(self.hierps_resume)
            self.hierps_resume = None
        self.data = (x for x in self.dataloader)
        return self.dataloader

    def state_dict(self) -> dict[str, Any]:
        """The position after the batch last yielded in this epoch (before the first epoch, or loaded
        and not yet iterated: the position to start at)."""
        current = getattr(self, "dataloader", None)
        state = (
            self.hierps_resume if self.hierps_resume is not None or current is None else current.state_dict()
        )
        return {"format": _FORMAT, "epoch": state}

    def load_state_dict(self, state: Any) -> None:
        """Start the next ``iter()`` at ``state`` (:meth:`state_dict`)."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ConfigError(
                f"DeepSpeed loader: expected a state of its state_dict() (format {_FORMAT}). Got {str(state)[:120]}."
            )
        self.hierps_resume = state["epoch"]
