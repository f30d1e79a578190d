"""The life of a feature: sightings and counters, admission, shrinking, export for serving.

- :mod:`._admission`: keys waiting for a row (exact counts, bounded);
- :class:`FeatureLifeCycle` (:mod:`._lifecycle`): counters, admission, ``observe``, ``shrink``;
- :mod:`._export`: full and delta exports (plain Zarr v3), read back by :mod:`hierps.serving`;
- :mod:`._inspection`: ``hierps inspect``.
"""
