"""``hierps bench``: benchmarks of the store, beside the core (not imported by it).

:mod:`.run` (the ``hierps bench`` command and its worker processes), :mod:`.variants` (what each
measured variant trains), :mod:`.machine` (this machine's RAM and disk, measured in the same run),
:mod:`.report` (goals, tables, chart), :mod:`.dist` (1 vs 2 ranks).
"""
