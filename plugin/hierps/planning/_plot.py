"""``hierps plan --plot``: a plan as a PNG, bytes per tier beside where each pass's rows come from."""

from __future__ import annotations

import os

from hierps.planning._plan import Plan

__all__ = ["plot_plan"]

_GiB = float(1 << 30)


def plot_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write ``path`` (PNG): per rank, the device, RAM (rows and SSD index) and SSD (live, steady,
    peak) bytes against their budgets; per pass, the device hit rate and the RAM / SSD / new shares
    of the rows loaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = ["device", "RAM rows", "SSD index", "SSD live", "SSD steady", "SSD peak"]
    values = [
        plan.device_bytes,
        plan.ram_bytes,
        plan.index_ram_bytes,
        plan.ssd_live_bytes,
        plan.ssd_steady_bytes,
        plan.ssd_peak_bytes,
    ]
    left.bar(names, [v / _GiB for v in values], color=["#4c72b0", "#55a868", "#8172b2", *["#c44e52"] * 3])
    for x, budget in ((0, plan.device_budget), (1, plan.memory_budget)):
        left.plot([x - 0.4, x + 0.4], [budget / _GiB] * 2, "k--")
    left.set_yscale("symlog", linthresh=1.0)
    left.set_ylabel("GiB per rank (budgets dashed)", fontsize=8)
    left.set_title(f"bytes per tier, {plan.world_size} rank(s)", fontsize=9)
    passes = [p.pass_index for p in plan.passes]
    for field, label in (
        ("device_hit_rate", "device hit (of the working set)"),
        ("ram_hit_rate", "RAM (of rows loaded)"),
        ("ssd_hit_rate", "SSD (of rows loaded)"),
        ("new_rate", "new (of rows loaded)"),
    ):
        right.plot(passes, [getattr(p, field) for p in plan.passes], marker="o", label=label)
    right.set_xticks(passes)
    right.set_ylim(0, 1)
    right.set_xlabel("pass", fontsize=8)
    right.set_title("where each pass's rows come from", fontsize=9)
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
