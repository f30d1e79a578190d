"""The three tiers of the store, from fastest to largest: device, memory (RAM), SSD."""

from hierps.tiers.device import DeviceTier
from hierps.tiers.memory import MemoryTier
from hierps.tiers.ssd import SsdTier, TableIndex

__all__ = ["DeviceTier", "MemoryTier", "SsdTier", "TableIndex"]
