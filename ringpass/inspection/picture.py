"""Pictures of an `Inspection` (``ringpass inspect --picture FILE.png|.svg``), drawn with matplotlib.

Left: each captured graph condensed to one box per module, attention region, input and inserted
collective (`graph_view.condensed`), in graph order, coloured by placement, the op a refusal names in red;
arrows join boxes whose values flow into each other. Right: the ring schedule of each distinct attention as a
rank x step grid (diagonal / full / partial / skipped blocks) for the chosen layout, beside the contiguous layout.
matplotlib is an optional extra: ``pip install ringpass[viz]``.
"""

from __future__ import annotations

import os

import networkx as nx

from lowering.costmodel import ring_cost
from lowering.errors import InvalidInputError
from lowering.layout import Layout
from ringpass.inspection.graph_view import condensed, to_networkx

PLACEMENT_COLOURS = {
    "sharded": "#8fd18f",
    "whole": "#f5b971",
    "replicated": "#c9d6ea",
    "partial": "#d4b2e8",
    "output": "#dddddd",
}
KIND_EDGES = {"ring": "#1a5fb4", "collective": "#c01c28", "input": "#444444", "module": "#888888", "refused": "#c01c28"}
BLOCK_COLOURS = {"diagonal": "#1a5fb4", "full": "#3a9a3a", "partial": "#9ccf9c", "skipped": "#f0f0f0"}


def draw(inspection, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyBboxPatch, Patch
    except ImportError:
        raise InvalidInputError("Pictures need matplotlib, an optional extra: pip install 'ringpass[viz]'") from None
    extension = os.path.splitext(path)[1].lower()
    if extension not in (".png", ".svg"):
        raise InvalidInputError(f"--picture {path!r}: the file must end in .png or .svg.")
    boxes = [condensed(to_networkx(g.gm, g.placement, g.axes, blocking=g.blocking)) for g in inspection.graphs]
    rings = [(g.report, indices, cost) for g in inspection.graphs for indices, cost in g.report.ring_costs()]
    rows = max([len(b) for b in boxes] + [1])
    widths = [5.5] * len(boxes) + ([4.5, 4.5] if rings else []) or [5.5]
    figure = plt.figure(figsize=(sum(widths) + 1, max(4.0, 0.42 * rows + 1.5)))
    grid = figure.add_gridspec(max(len(rings), 1), len(widths), width_ratios=widths)
    if not boxes:
        axis = figure.add_subplot(grid[:, 0])
        axis.text(0.5, 0.5, "Dynamo captured no graph", ha="center", va="center")
        axis.axis("off")
    for i, (box_graph, graph) in enumerate(zip(boxes, inspection.graphs)):
        axis = figure.add_subplot(grid[:, i])
        _draw_boxes(axis, box_graph, f"graph {i}: {graph.report.status}", FancyBboxPatch)
    for row, (_report, indices, cost) in enumerate(rings):
        contiguous = ring_cost(Layout("contiguous", cost.layout.world_size, cost.layout.seq_len), cost.shape)
        for column, shown in enumerate((cost, contiguous)):
            axis = figure.add_subplot(grid[row, len(boxes) + column])
            _draw_schedule(
                axis,
                shown,
                f"attention(s) {indices[0]}..{indices[-1]}" if len(indices) > 1 else f"attention {indices[0]}",
            )
    handles = [Patch(color=c, label=f"value: {p}") for p, c in PLACEMENT_COLOURS.items()]
    handles += [Patch(color=c, label=f"block: {b}") for b, c in BLOCK_COLOURS.items()]
    figure.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, format=extension[1:], dpi=110)
    plt.close(figure)


def _draw_boxes(axis, boxes: nx.DiGraph, title: str, box_patch) -> None:
    order = list(nx.topological_sort(boxes)) if nx.is_directed_acyclic_graph(boxes) else list(boxes)
    order.sort(key=lambda name: "backward" in name)  # backward-only boxes (gradient reductions) last
    y = {name: -i for i, name in enumerate(order)}
    for name in order:
        data = boxes.nodes[name]
        fill = "#f66151" if data["kind"] == "refused" else PLACEMENT_COLOURS.get(data["placement"], "#ffffff")
        axis.add_patch(
            box_patch(
                (0.05, y[name] - 0.35),
                0.9,
                0.7,
                boxstyle="round,pad=0.02,rounding_size=0.08",
                facecolor=fill,
                edgecolor=KIND_EDGES[data["kind"]],
                linewidth=2 if data["kind"] != "module" else 1,
            )
        )
        label = name if len(name) <= 60 else name[:57] + "..."
        axis.text(
            0.5,
            y[name],
            label,
            ha="center",
            va="center",
            fontsize=7,
            fontweight="bold" if data["kind"] in ("ring", "collective", "refused") else "normal",
        )
    for a, b in boxes.edges:
        if y[b] == y[a] - 1:
            axis.annotate(
                "", xy=(0.5, y[b] + 0.36), xytext=(0.5, y[a] - 0.36), arrowprops=dict(arrowstyle="->", lw=0.8)
            )
        else:  # a skip connection: an arc on the right
            axis.annotate(
                "",
                xy=(0.95, y[b]),
                xytext=(0.95, y[a]),
                arrowprops=dict(arrowstyle="->", lw=0.6, color="#777777", connectionstyle="arc3,rad=-0.3"),
            )
    axis.set_xlim(0, 1.25)
    axis.set_ylim(-len(order) + 0.4, 0.6)
    axis.set_title(title, fontsize=10)
    axis.axis("off")


def _draw_schedule(axis, cost, label: str) -> None:
    from matplotlib.colors import ListedColormap

    names = list(BLOCK_COLOURS)
    table = [[names.index(word) for word in row] for row in cost.schedule]
    axis.imshow(
        table, cmap=ListedColormap([BLOCK_COLOURS[n] for n in names]), vmin=0, vmax=len(names) - 1, aspect="auto"
    )
    p = cost.layout.world_size
    axis.set_xticks(range(p))
    axis.set_yticks(range(p))
    axis.tick_params(labelsize=7)
    axis.set_xlabel("ring step", fontsize=8)
    axis.set_ylabel("rank", fontsize=8)
    busiest = max(sum(row) for row in cost.flops_forward)
    axis.set_title(f"{label}: {cost.layout.kind}\nbusiest rank {busiest / 1e12:.3g} TFLOP forward", fontsize=9)
