"""The online loop: a stream of log files in, passes trained, fresh rows published for serving.

- :class:`ParquetStream`: mini-batches of a directory of Parquet logs that keep arriving, cut into
  passes by example count or event time, its position a checkpoint can keep.
- :class:`Publisher`: each new checkpoint's changed rows exported as a delta into the directory
  ``hierps.serving.open(directory, follow=...)`` follows, compacted into a new base on a schedule.
"""

from hierps.online._publish import Published, Publisher
from hierps.online._stream import ParquetStream

__all__ = ["ParquetStream", "Published", "Publisher"]
