"""The life of a feature: sightings and counters, admission, shrinking, export for serving.

- :mod:`._admission`: when a key waiting for a row earns it (its counts: :mod:`hierps.rows._pending`);
- :class:`FeatureLifeCycle` (:mod:`._lifecycle`): counters, admission, ``observe``, ``shrink``;
- :mod:`._export`: full and delta exports (plain Zarr v3), read back by :mod:`hierps.serving`;
  :func:`export_store` exports a store directory without opening it for training (``hierps export``);
- :mod:`._inspection`: ``hierps inspect``.
"""

from hierps.lifecycle._export import export_store

__all__ = ["export_store"]
