"""A horizontal bar chart without matplotlib: graphviz draws it, or we write SVG by hand.

:func:`bar_chart` builds a graphviz HTML-like table -- one row per bar: label, a coloured
cell whose width is proportional to the value, the value -- and renders it to PNG with
graphviz's ``dot``. Where ``dot`` is missing it writes the same chart as a small hand-made
SVG file instead (plain text, no dependency) and says so.
"""
from __future__ import annotations

import html
import os
import shutil
import subprocess
from typing import List, Optional, Sequence, Tuple


def _color(v: float, good: float, ok: float) -> str:
    return "#4caf50" if v >= good else ("#ffb300" if v >= ok else "#e53935")


def _dot_source(title: str, rows: Sequence[Tuple[str, float]], unit: str, good: float, ok: float,
                width_px: int) -> str:
    vmax = max([v for _, v in rows if v == v and v != float("inf")] + [1.0])
    cells = []
    for label, v in rows:
        finite = v == v and v != float("inf")
        w = max(1, int(width_px * (min(v, vmax) / vmax))) if finite and v > 0 else 1
        color = _color(v, good, ok) if finite else "#9e9e9e"
        text = f"{v:.1f} {unit}" if finite else str(v)
        cells.append(
            f'<TR><TD ALIGN="RIGHT">{html.escape(label)}</TD>'
            f'<TD ALIGN="LEFT" WIDTH="{width_px}"><TABLE BORDER="0" CELLPADDING="0" CELLSPACING="0"><TR>'
            f'<TD BGCOLOR="{color}" WIDTH="{w}" HEIGHT="14"></TD>'
            + (f'<TD WIDTH="{width_px - w}"></TD>' if width_px - w > 0 else "")
            + f'</TR></TABLE></TD><TD ALIGN="LEFT">{html.escape(text)}</TD></TR>')
    table = (f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="3"><TR><TD COLSPAN="3"><B>{html.escape(title)}</B>'
             f'</TD></TR>{"".join(cells)}</TABLE>>')
    return ('digraph chart {\n  graph [bgcolor="white", margin="0.2"];\n  node [shape=plaintext, '
            f'fontname="Helvetica", fontsize=11];\n  chart [label={table}];\n}}\n')


def _svg(title: str, rows: Sequence[Tuple[str, float]], unit: str, good: float, ok: float, width_px: int) -> str:
    vmax = max([v for _, v in rows if v == v and v != float("inf")] + [1.0])
    lw, rh, top = 190, 20, 30
    h = top + rh * len(rows) + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{lw + width_px + 90}" height="{h}" '
             'font-family="Helvetica,Arial,sans-serif" font-size="12">',
             '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="10" y="18" font-weight="bold">{html.escape(title)}</text>']
    for i, (label, v) in enumerate(rows):
        y = top + i * rh
        finite = v == v and v != float("inf")
        w = max(1, int(width_px * min(v, vmax) / vmax)) if finite and v > 0 else 1
        parts.append(f'<text x="{lw - 6}" y="{y + 13}" text-anchor="end">{html.escape(label)}</text>')
        parts.append(f'<rect x="{lw}" y="{y + 2}" width="{w}" height="14" '
                     f'fill="{_color(v, good, ok) if finite else "#9e9e9e"}"/>')
        parts.append(f'<text x="{lw + w + 6}" y="{y + 13}">{f"{v:.1f} {unit}" if finite else v}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def bar_chart(path_stem: str, title: str, rows: Sequence[Tuple[str, float]], unit: str = "dB",
              good: float = 30.0, ok: float = 20.0, width_px: int = 320) -> str:
    """Write the chart as ``<path_stem>.png`` (graphviz) or ``<path_stem>.svg`` (fallback);
    returns the path written."""
    os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
    dot = shutil.which("dot")
    if dot is not None:
        src = _dot_source(title, rows, unit, good, ok, width_px)
        out = path_stem + ".png"
        r = subprocess.run([dot, "-Tpng", "-o", out], input=src.encode(), capture_output=True)
        if r.returncode == 0:
            return out
    out = path_stem + ".svg"
    with open(out, "w") as f:
        f.write(_svg(title, rows, unit, good, ok, width_px))
    return out
