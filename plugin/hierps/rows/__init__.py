"""What a row is: a table's settings, the ids that key it, and the columns it carries.

A row of a table of dim ``D`` is ``[weights (D) | optimizer state | counters]``, float32, and moves
whole through every tier: :class:`TableInfo` (the table and its row width), :mod:`._ids` (raw int64
feature ids), :mod:`._initializers` (the row a key starts from, derived from ``(seed, table, key)``),
:mod:`._optim` (sparse optimizers and their state columns), :mod:`._counters` (sightings, shows,
clicks, last pass).
"""

from hierps.rows._counters import NUM_COUNTERS
from hierps.rows._initializers import initial_rows, table_salt
from hierps.rows._optim import apply_step, initial_state, state_width
from hierps.rows._table import TableInfo

__all__ = [
    "NUM_COUNTERS",
    "TableInfo",
    "apply_step",
    "initial_rows",
    "initial_state",
    "state_width",
    "table_salt",
]
