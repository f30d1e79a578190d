"""What a row is: a table's settings, the ids that key it, and the columns it carries.

A row of a table of dim ``D`` is ``[weights (D) | optimizer state | counters]``, float32, and moves
whole through every tier: :class:`TableInfo` (the table and its row width), :mod:`._ids` (raw int64
feature ids), :mod:`._initializers` (the row a key starts from, derived from ``(seed, table, key)``),
:mod:`._optim` (sparse optimizers and their state columns), :mod:`._counters` (sightings, shows,
clicks, last pass), :mod:`._layout` (:func:`row_layout`: a row's fields and bytes as stored, in
fp32, bf16 or fp16), :mod:`._pending` (keys counted until they earn a row).

:func:`splitmix64` is the one 64-bit hash of the package: initial rows, key filters, the row cache,
the owner rank of a key, and the demo's synthetic ids all derive from it.
"""

from hierps.rows._counters import NUM_COUNTERS
from hierps.rows._initializers import initial_rows, splitmix64, table_salt
from hierps.rows._layout import RowLayout, row_layout
from hierps.rows._optim import apply_step, initial_state, state_width
from hierps.rows._table import TableInfo

__all__ = [
    "NUM_COUNTERS",
    "RowLayout",
    "TableInfo",
    "apply_step",
    "initial_rows",
    "initial_state",
    "row_layout",
    "splitmix64",
    "state_width",
    "table_salt",
]
