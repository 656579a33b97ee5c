"""`zerodp compare`'s PNG plots: memory.png, step_time.png, communication.png and loss.png.

matplotlib is optional (zerodp's [plots] extra): it is imported only when `draw_plots` runs, and
`zerodp compare` checks for it first and writes report.md without plots when it is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from zerodp.report.frameworks import CATEGORIES


def draw_plots(out: Path, rows: list[dict]) -> list[str]:
    """memory.png, step_time.png, communication.png, loss.png into `out`; the names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if "error" not in r]
    figures = [("memory.png", _memory(plt, ran)) if any(r.get("peak") for r in ran) else None,
               ("step_time.png", _step_time(plt, ran)), ("communication.png", _communication(plt, ran)),
               ("loss.png", _loss(plt, ran))]
    written = []
    for name, fig in filter(None, figures):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written


def _height(ran: list[dict]) -> float:
    return 0.45 * len(ran) + 1.5


def _stacked(ax: Any, ran: list[dict], parts: list[str], value: Callable[[dict, str], float], unit: str) -> None:
    """One horizontal bar per framework, `parts` stacked left to right."""
    labels = [r["label"] for r in ran]
    left = [0.0] * len(ran)
    for part in parts:
        widths = [value(r, part) for r in ran]
        ax.barh(labels, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))


def _memory(plt: Any, ran: list[dict]) -> Any:
    fig, ax = plt.subplots(figsize=(10, _height(ran)))
    _stacked(ax, ran, list(CATEGORIES), lambda r, c: r["memory"].get(c, 0) / 1e6, "MB per rank at the peak (rank 0)")
    ax.set_title("Peak memory by category")
    peaks = sorted(r["peak"] / 1e6 for r in ran if r.get("peak"))
    typical = peaks[len(peaks) // 2]
    if peaks[-1] > 5 * typical:  # one framework's peak would flatten the rest: cut the axis, label it
        limit = 1.3 * max(p for p in peaks if p <= 5 * typical)
        ax.set_xlim(0, limit)
        for y, r in enumerate(ran):
            if r.get("peak") and r["peak"] / 1e6 > limit:
                ax.text(limit * 0.98, y, f"{r['peak'] / 1e6:,.0f} MB, off the scale", ha="right", va="center",
                        fontsize=8, color="white")
    return fig


def _step_time(plt: Any, ran: list[dict]) -> Any:
    fig, ax = plt.subplots(figsize=(10, _height(ran)))
    _stacked(ax, ran, ["forward", "backward", "step"], lambda r, p: r["seconds"][p], "seconds per step (median, rank 0)")
    ax.set_title("Step time: forward, backward (with its communication), optimizer step")
    return fig


def _communication(plt: Any, ran: list[dict]) -> Any:
    fig, ax = plt.subplots(figsize=(10, _height(ran)))
    ys = range(len(ran))
    ax.barh([y - 0.2 for y in ys], [(r["bytes_written"] or 0) / 1e6 for r in ran], height=0.4, label="sent on the wire")
    ax.barh([y + 0.2 for y in ys], [r["ring_bytes"] / 1e6 for r in ran], height=0.4, label="paper's volume x (N-1)/N")
    ax.set_yticks(list(ys), [r["label"] for r in ran])
    ax.invert_yaxis()
    ax.set_xlabel("MB per rank and step")
    ax.set_title("Communication per step")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def _loss(plt: Any, ran: list[dict]) -> Any:
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in ran:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], marker="o", markersize=3, label=r["label"], alpha=0.8)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (rank 0)")
    ddp = next((r for r in ran if r["framework"] == "ddp"), None)
    spread = "" if ddp is None else ": every curve within " + \
        f"{max(abs(a - b) for r in ran for a, b in zip(r['losses'], ddp['losses'])):.1e} of DDP's"
    ax.set_title(f"Loss curves, overlaid (the same data and initialisation){spread}", fontsize=10)
    ax.legend(fontsize=7)
    return fig

