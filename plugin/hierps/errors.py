"""The one error hierarchy of hierps.

Every message says what happened, the value found, and what to do next::

    HierpsError
    ├── ConfigError            a setting has a bad value (ValueError)
    │   ├── MissingPartsError  parts of a sharded checkpoint on no disk a rank reaches (a host missing)
    │   └── LogFileError       a log file a stream cannot read: torn, foreign, out of order, late
    ├── InvalidIdsError        ids of the wrong dtype / device / shape (TypeError)
    ├── OffsetsError           offsets that do not describe the bags of the ids (ValueError)
    ├── DeviceBudgetError      one mini-batch's rows alone exceed the device budget
    ├── NonFiniteGradientError a NaN / inf gradient reached the sparse step
    ├── TableMismatchError     a table reopened with another dim / optimizer
    ├── StoreFormatError       a directory that is not a hierps store, or of another format version
    ├── CorruptStoreError      a checksum, manifest or array layout that does not verify
    ├── StoreFullError         the disk under the store ran out of space (OSError, errno ENOSPC)
    ├── CheckpointRetiredError a reader's checkpoint was retired by the training process
    ├── StoreLockedError       a second writer on the same store
    ├── StoreClosedError       a store used after close()
    ├── PeerLostError          a collective with the other ranks failed: a rank died or hung
    ├── StaleWeightError       an embedding weight used after its rows moved into a store
    └── NotSupportedError      an operation this kind of store does not offer yet (NotImplementedError)
"""

from __future__ import annotations

import errno

__all__ = [
    "CheckpointRetiredError",
    "ConfigError",
    "CorruptStoreError",
    "DeviceBudgetError",
    "HierpsError",
    "InvalidIdsError",
    "LogFileError",
    "MissingPartsError",
    "NonFiniteGradientError",
    "NotSupportedError",
    "OffsetsError",
    "PeerLostError",
    "StoreClosedError",
    "StoreFormatError",
    "StoreFullError",
    "StaleWeightError",
    "StoreLockedError",
    "TableMismatchError",
]


class HierpsError(Exception):
    """Base of every error hierps raises on purpose."""


class ConfigError(HierpsError, ValueError):
    """A setting (store argument or ``hierarchical_ps`` config key) has a bad value."""


class MissingPartsError(ConfigError):
    """Parts of a sharded checkpoint lie on no disk a rank of this job reaches: their host did not
    come back, its disk was replaced, or fewer hosts were started than saved it. Nothing was opened,
    created or deleted.

    ``parts``: the missing parts (part q is rank q's of the checkpoint, in ``rank-{q:05d}/``);
    ``checkpoint``: the id of the checkpoint they belong to.
    """

    def __init__(self, message: str, parts: tuple[int, ...] = (), checkpoint: int | None = None) -> None:
        super().__init__(message)
        self.parts = parts
        self.checkpoint = checkpoint


class LogFileError(ConfigError):
    """A file of a log stream (:class:`hierps.online.ParquetStream`) cannot be read as one: torn,
    foreign (other columns or types), out of time order, or arrived after the stream passed its place."""


class InvalidIdsError(HierpsError, TypeError):
    """Feature ids that are not an integer tensor on the expected device."""


class NotSupportedError(HierpsError, NotImplementedError):
    """An operation this kind of store does not offer (yet), e.g. ``observe`` on a sharded store."""


class OffsetsError(HierpsError, ValueError):
    """Offsets that do not describe bags of the ids they come with."""


class DeviceBudgetError(HierpsError, MemoryError):
    """A single mini-batch needs more rows than the device budget holds."""


class NonFiniteGradientError(HierpsError, FloatingPointError):
    """A NaN or inf gradient reached the sparse optimizer step; no row was updated."""


class TableMismatchError(HierpsError, ValueError):
    """A table was reopened with a dim or optimizer other than the one it was created with."""


class StoreFormatError(HierpsError):
    """The directory is not a hierps store, or was written by an incompatible format version."""


class CorruptStoreError(HierpsError):
    """A file of the store failed its checksum or could not be parsed."""


class StoreFullError(HierpsError, OSError):
    """The file system under the store has no space left (``errno`` is ``ENOSPC``).

    Nothing committed is lost: the last checkpoint stays intact, and rows not yet written stay in
    RAM, so ``checkpoint()`` may be called again once space is freed.
    """

    def __init__(self, message: str, path: str | None = None, needed: int | None = None) -> None:
        super().__init__(errno.ENOSPC, message)
        self.filename = path
        self.needed = needed

    def __str__(self) -> str:
        return str(self.strerror)


class CheckpointRetiredError(HierpsError):
    """A reader's checkpoint was retired (and its files collected) by the process training the store."""


class StoreLockedError(HierpsError):
    """Another process holds the store open for writing."""


class StoreClosedError(HierpsError):
    """The store was used after ``close()``."""


class PeerLostError(HierpsError, RuntimeError):
    """A collective operation with the other ranks failed or timed out (a rank died or hung)."""


class StaleWeightError(HierpsError, RuntimeError):
    """A module's old ``weight`` was used after ``hierps.deepspeed.initialize`` moved its rows into a store."""
