"""Capacity planning: what a store of given tables will take in each tier and how its passes,
checkpoints and restores will go, before it trains (``hierps plan``).

::

    import hierps.planning as hp
    p = hp.plan({"user": hp.TableInput(dim=64, keys=10**9, spec=hierps.TableSpec.of(optimizer="adam"))},
                hp.PowerLaw({"user": hp.TableDraw(10**9, 1.05)}, examples_per_pass=10**7),
                memory_budget="256GiB", device_budget="40GiB", world_size=8,
                machine=hp.load_machine("machine.json"))
    print(hp.format_plan(p))

- :mod:`._sizes` — bytes per row in each tier, from the store's layout and its segment writer;
- :mod:`._traffic` — passes of ids: a sample of real batches (a file, or :func:`sample_loader` of the
  user's loader), or a power law; spatial sampling;
- :mod:`._simulate` — the passes replayed through the store's RAM tier on keys alone;
- :mod:`._machine` — the machine's rates, from ``hierps bench`` JSON or measured now;
- :mod:`._plan` — the plan itself and its text; :mod:`._spec` — inputs from a spec or DeepSpeed config;
- :mod:`._plot` — the plan as a PNG (``hierps plan --plot``).
"""

from hierps.planning._machine import Machine, checkpoint_costs, load_machine, measure_machine
from hierps.planning._plan import PassPlan, Plan, TableInput, TablePlan, format_plan, plan
from hierps.planning._plot import plot_plan
from hierps.planning._simulate import PassCounts, replay
from hierps.planning._sizes import RowBytes, row_bytes
from hierps.planning._spec import plan_from_spec, read_spec
from hierps.planning._traffic import (
    BatchTraffic,
    PowerLaw,
    SampledTraffic,
    TableDraw,
    keep_fraction,
    load_sample,
    sample_loader,
)

__all__ = [
    "BatchTraffic",
    "Machine",
    "PassCounts",
    "PassPlan",
    "Plan",
    "PowerLaw",
    "RowBytes",
    "SampledTraffic",
    "TableDraw",
    "TableInput",
    "TablePlan",
    "checkpoint_costs",
    "format_plan",
    "keep_fraction",
    "load_machine",
    "load_sample",
    "measure_machine",
    "plan",
    "plan_from_spec",
    "plot_plan",
    "read_spec",
    "replay",
    "row_bytes",
    "sample_loader",
]
