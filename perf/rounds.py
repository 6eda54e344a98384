"""Medians over alternating rounds, as the side-by-side benchmarks report them (perf/serving_ab.py,
perf/codec_stage.py): one table cell per side, its median and each round's value in brackets."""
from __future__ import annotations

import statistics


def median_cells(rounds: dict[str, list[float | None]]) -> tuple[dict[str, float | None], dict[str, str]]:
    """side -> each round's value (None where a round had none) => (side -> median, side -> "median [values]")."""
    values = {side: [v for v in vals if v is not None] for side, vals in rounds.items()}
    med = {side: statistics.median(v) if v else None for side, v in values.items()}
    cells = {side: f"{med[side]:.3g} [{', '.join(f'{x:.3g}' for x in values[side])}]" if med[side] is not None
             else "-" for side in rounds}
    return med, cells
