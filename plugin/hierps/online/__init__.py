"""The online loop: a stream of log files in, passes trained, fresh rows published for serving.

- :class:`ParquetStream`: mini-batches of a directory of Parquet logs that keep arriving, cut into
  passes by example count or event time, its position a checkpoint can keep.
"""

from hierps.online._stream import ParquetStream

__all__ = ["ParquetStream"]
