"""``hierps demo``: the demo application, beside the core (not imported by it).

:mod:`.app` (the demo: a DLRM on Criteo-like clicks through a hierps store), :mod:`.data`
(synthetic Criteo-format data), :mod:`.models` (DLRM, Wide), :mod:`.metrics` (AUC, log loss).
"""
