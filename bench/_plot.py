"""The bench's plots: each variant's time over the floor's, per workload; and the
leaf-scaling sweep (microseconds per call against the number of leaves).

Drawn to be read: where two variants could land on the same spot, they are drawn
at different heights (the ratio plot) or in different line styles and markers
(the sweep), the legend sits outside the axes, and the footer (machine, versions,
command) is part of the saved image, never cut off.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any, Callable

from ._harness import Row
from ._sweep import PREFIX as SWEEP_PREFIX

# fastcall's variants: filled, in cool colours; the peers they replace: open, in warm
# colours; anything else (a hand-written floor such as split/merge): grey crosses.
FASTCALL_STYLES = [("o", "#1f4e9c"), ("s", "#2a9d8f"), ("D", "#6a3d9a"), ("^", "#0b6e4f")]
PEER_STYLES = [
    ("o", "#d62728"), ("s", "#ff7f0e"), ("D", "#8c564b"), ("^", "#e377c2"), ("v", "#b8860b"),
    ("P", "#c51b7d"), ("X", "#a0522d"), ("h", "#e6550d"), ("<", "#7f0000"), (">", "#d6616b"),
]
OTHER_STYLES = [("x", "#555555"), ("+", "#888888"), ("1", "#333333")]
DPI = 110
# The ratio plot's layout: a lane is one row of markers, in inches; each workload's band
# holds as many lanes as its markers need (`_lanes`) plus BAND_PAD lanes of space; a
# marker's width is taken as this share of the axes' width (with a margin).
LANE_INCHES = 0.14
BAND_PAD = 0.7
MARKER_SHARE = 0.022
LEGEND_LINE_INCHES = 0.19


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # (files only: never a window, also where a display exists)
    import matplotlib.pyplot as plt

    return plt


def _role(variant: str, peers: set[str]) -> str:
    if variant.startswith("fastcall"):
        return "fastcall"
    return "peer" if variant in peers else "other"


def _styles(variants: list[str], peers: set[str]) -> dict[str, dict[str, Any]]:
    """Marker keyword arguments per variant name: the same name looks the same in every
    workload, and the role (fastcall, peer, other) shows in fill and colour family."""
    palettes = {"fastcall": FASTCALL_STYLES, "peer": PEER_STYLES, "other": OTHER_STYLES}
    used = {role: 0 for role in palettes}
    out = {}
    for name in variants:
        role = _role(name, peers)
        marker, color = palettes[role][used[role] % len(palettes[role])]
        used[role] += 1
        fill = color if role == "fastcall" else "none"
        out[name] = dict(marker=marker, color=color, markerfacecolor=fill, markeredgecolor=color, linestyle="none")
    return out


def _ordered(variants: list[str], peers: set[str]) -> list[str]:
    """fastcall's variants first, then the peers, then the rest (each in order of first
    appearance): the legend and each workload's markers read top down in that order."""
    rank = {"fastcall": 0, "peer": 1, "other": 2}
    return sorted(dict.fromkeys(variants), key=lambda v: rank[_role(v, peers)])


def _footer(fig: Any, machine_line: str) -> None:
    """The machine line and command under the figure's bottom edge: below everything the
    layout placed, the legend included; the tight bounding box at saving takes it in."""
    lines = [textwrap.fill(line, 150) for line in machine_line.splitlines()]
    fig.text(0.01, 0, "\n".join(lines), ha="left", va="top", fontsize=7, color="#444444")


def _save(fig: Any, path: str) -> None:
    fig.savefig(path, dpi=DPI, bbox_inches="tight", pad_inches=0.15)  # (tight: nothing clipped)
    _pyplot().close(fig)


def _ratio_ticks(ax: Any, lo: float, hi: float) -> None:
    ticks = [t for t in (0.5, 1, 1.5, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000) if lo <= t <= hi]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.xaxis.set_minor_formatter("")


def _lanes(items: list[Any], apart: Callable[[Any, Any], bool]) -> list[int]:
    """A lane (0, 1, ...) for each item, in the order given: the first lane where the item
    is `apart` from every item already there. Markers that would overlap go to different
    lanes; the rest stay in lane 0."""
    taken: list[list[Any]] = []
    out = []
    for item in items:
        lane = next((i for i, there in enumerate(taken) if all(apart(item, other) for other in there)), len(taken))
        if lane == len(taken):
            taken.append([])
        taken[lane].append(item)
        out.append(lane)
    return out


def _log_apart(gap: float) -> Callable[[float, float], bool]:
    """Whether two values on a log axis are at least `gap` (log10 units) apart."""
    return lambda a, b: abs(math.log10(a) - math.log10(b)) >= gap


def ratios(rows: list[Row], peers: set[str], path: str, machine_line: str) -> bool:
    """Per workload, each timed variant's time over the floor's ("x floor"), log scale (the
    floor itself is the dotted line at 1x; the sweep's workloads have their own plot).
    `peers`: every variant name some workload lists as a peer of fastcall. False if there
    is nothing to plot."""
    rows = [
        r for r in rows if r.x_floor is not None and r.variant != "floor" and not r.workload.startswith(SWEEP_PREFIX)
    ]
    if not rows:
        return False
    plt = _pyplot()
    values = [r.x_floor for r in rows]
    lo, hi = min(min(values), 1.0) / 1.15, max(values) * 1.15
    gap = MARKER_SHARE * math.log10(hi / lo)
    order = _ordered([r.variant for r in rows], peers)
    styles = _styles(order, peers)
    bands = []  # (workload, [(row, lane)], lanes)
    for name in dict.fromkeys(r.workload for r in rows):
        mine = sorted((r for r in rows if r.workload == name), key=lambda r: order.index(r.variant))
        lanes = _lanes([r.x_floor for r in mine], _log_apart(gap))
        bands.append((name, list(zip(mine, lanes)), max(lanes) + 1))
    height = sum(n + BAND_PAD for _, _, n in bands)
    # (tall enough for the legend beside the axes: one entry per variant and four more lines)
    inches = max(LANE_INCHES * height + 1.6, LEGEND_LINE_INCHES * (len(order) + 4))
    fig, ax = plt.subplots(figsize=(9, inches), layout="constrained")
    top, ticks = 0.0, []
    for i, (name, placed, n) in enumerate(bands):
        if i % 2:
            ax.axhspan(top - n - BAND_PAD, top, color="#f0f0f0", zorder=0)
        for r, lane in placed:
            ax.plot([r.x_floor], [top - BAND_PAD / 2 - 0.5 - lane], markersize=5.5, zorder=3, **styles[r.variant])
        ticks.append(top - (n + BAND_PAD) / 2)
        top -= n + BAND_PAD
    floor = ax.axvline(1.0, color="black", linestyle=":", linewidth=1, zorder=2)
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    _ratio_ticks(ax, lo, hi)
    ax.tick_params(axis="x", labeltop=True, top=True)  # (a tall plot: a scale at both ends)
    ax.set_yticks(ticks, [name for name, _, _ in bands], fontsize=8)
    ax.tick_params(axis="y", length=0)
    ax.set_ylim(top, 0)
    ax.grid(True, axis="x", which="major", alpha=0.35)
    ax.set_xlabel("time per call over the floor's (x floor, log scale; lower is faster)")
    ax.set_title("Each call path's time over the floor's, per workload")
    handles = [floor] + [ax.plot([], [], markersize=6, **styles[v])[0] for v in order]
    fig.legend(
        handles,
        ["floor: jax.jit on the flat leaves"] + order,
        loc="outside right upper",
        fontsize=8,
        title="filled: fastcall\nopen: the peers it replaces\ncrosses: other references",
        title_fontsize=8,
    )
    _footer(fig, machine_line)
    _save(fig, path)
    return True


def _sweep_series(rows: list[Row]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.workload.startswith(SWEEP_PREFIX) and r.median_us is not None:
            series.setdefault(r.variant, []).append((int(r.workload[len(SWEEP_PREFIX) :]), r.median_us))
    return {name: sorted(points) for name, points in series.items()}


SWEEP_SPREAD = 1.09  # (the sideways factor between lines moved apart: a marker's width)
SWEEP_MARKER_SHARE = 0.025  # (a marker's height as a share of the axes' height, with a margin)


def _lines_apart(gap: float) -> Callable[[dict[int, float], dict[int, float]], bool]:
    """Whether two lines ({leaves: us}) are `gap` apart (log10 units) at every leaf count."""
    apart = _log_apart(gap)
    return lambda a, b: all(apart(a[n], b[n]) for n in a.keys() & b.keys())


LINESTYLES = ["-", "--", "-.", ":", (0, (5, 1, 1, 1)), (0, (3, 1, 1, 1, 1, 1))]


def leaf_scaling(rows: list[Row], peers: set[str], path: str, machine_line: str) -> bool:
    """The sweep as a log-log plot of us/call against leaves; False without sweep rows.

    Several call paths sit on the floor's line (that is the point of fastcall): the floor
    is drawn as a wide pale band under everything, each other line gets its own dash
    pattern and marker, and lines whose markers would overlap are moved sideways by a few
    % (SWEEP_SPREAD), so that every marker stays visible where the times coincide."""
    series = _sweep_series(rows)
    if not series:
        return False
    plt = _pyplot()
    order = _ordered(list(series), peers)
    styles = _styles(order, peers)
    fig, ax = plt.subplots(figsize=(9, 5.5), layout="constrained")
    lines = [name for name in order if name != "floor"]
    if "floor" in series:
        xs, ys = zip(*series["floor"])
        ax.plot(xs, ys, color="#bbbbbb", linewidth=9, alpha=0.6, solid_capstyle="round", label="floor", zorder=1)
    times = [us for points in series.values() for _, us in points]
    gap = SWEEP_MARKER_SHARE * math.log10(max(times) / min(times))
    lanes = _lanes([dict(series[name]) for name in lines], _lines_apart(gap))
    for k, (name, lane) in enumerate(zip(lines, lanes)):
        # lane 0 in place, then one step right, one left, two right, ...
        shift = SWEEP_SPREAD ** ((lane + 1) // 2 * (1 if lane % 2 else -1))
        xs, ys = zip(*series[name])
        style = dict(styles[name], linestyle=LINESTYLES[k % len(LINESTYLES)])
        ax.plot([x * shift for x in xs], ys, linewidth=1.6, markersize=6, label=name, zorder=3 + k, **style)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("array leaves in the model (lines that would overlap moved sideways by 9%, to stay apart)")
    ax.set_ylabel("microseconds per call (median of interleaved rounds)")
    ax.set_title("Dispatch cost against the number of leaves")
    ax.grid(True, which="both", alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=8)
    _footer(fig, machine_line)
    _save(fig, path)
    return True
