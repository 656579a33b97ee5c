"""`zerodp compare`'s DIR/report.md (the verdict and one table per measurement) and DIR/results.json."""

from __future__ import annotations

import json
from pathlib import Path

from zerodp.report.frameworks import CATEGORIES, FRAMEWORKS
from zerodp.sizes import format_megabytes


def _ddp_row(rows: list[dict]) -> dict | None:
    return next((r for r in rows if "error" not in r and r["framework"] == "ddp"), None)


def verdict(rows: list[dict], nproc: int, tie: float = 0.05) -> str:
    """The report's one paragraph: which to use on this model and these ranks, and why. Frameworks
    within `tie` (default 5%) of the fastest step time count as fast as it; of those, the one
    holding the least memory at its peak is the pick."""
    ran = [r for r in rows if "error" not in r]
    if not ran:
        return "No framework ran; see the table for each one's reason."
    fastest = min(ran, key=lambda r: r["seconds"]["total"])
    with_peak = [r for r in ran if r.get("peak")]
    near = [r for r in with_peak if r["seconds"]["total"] <= fastest["seconds"]["total"] * (1 + tie)] or [fastest]
    best = min(near, key=lambda r: r["peak"]) if with_peak else fastest
    ddp = _ddp_row(rows)
    vs = lambda r: f"{r['seconds']['total'] / ddp['seconds']['total']:.2f}x DDP's step time" if ddp else \
        f"{r['seconds']['total']:.3f} s/step"  # noqa: E731
    mb = lambda r: f"{format_megabytes(r['peak'], places=1)} MB"  # noqa: E731
    text = f"On this model and these {nproc} ranks, use **{best['label']}**: "
    if best is fastest:
        text += f"it was the fastest ({vs(best)})"
    else:
        text += (f"it is within {100 * tie:.0f}% of the fastest ({fastest['label']}, {vs(fastest)}; the two differ "
                 f"by less than this machine's noise between rounds) at {vs(best)}")
    if best.get("peak"):
        text += f", and of those that fast it holds the least memory ({mb(best)} per rank at its peak)"
    text += "."
    if with_peak:
        smallest = min(with_peak, key=lambda r: r["peak"])
        if smallest is not best:
            text += (f" {smallest['label']} holds the least ({mb(smallest)}, {100 * smallest['peak'] / best['peak']:.0f}% "
                     f"of the pick's) at {vs(smallest)}: choose it when memory, not time, is what runs out.")
    return text


def write_report(out: Path, rows: list[dict], meta: dict) -> None:
    """DIR/report.md and DIR/results.json."""
    ran = [r for r in rows if "error" not in r]
    lines = _head(rows, meta) + _step_time(rows) + _memory(ran) + _communication(ran, meta["nproc"]) + _loss(ran)
    lines += _step_reports(ran) + _plots(meta)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


def _head(rows: list[dict], meta: dict) -> list[str]:
    return [f"# zerodp compare: {meta['model']}", "",
            f"{meta['params'] / 1e6:.2f}M parameters, micro-batch {meta['micro_batch']} x {meta['seq_len']} tokens, "
            f"{meta['nproc']} ranks ({meta['device']}), {meta['dtype']}, {meta['rounds']} rounds x {meta['steps']} timed "
            f"steps after {meta['warmup']} warm-up steps; torch {meta['torch']}, {meta['date']}.", "",
            f"    {meta['command']}", "", "## Verdict", "", verdict(rows, meta["nproc"]), ""]


def _step_time(rows: list[dict]) -> list[str]:
    ddp = _ddp_row(rows)
    lines = ["## Step time (rank 0, median of the timed steps)", "",
             "| framework | s/step | vs DDP | forward | backward | optimizer step | tokens/s | rounds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | not run: {r['error']} | | | | | | |")
            continue
        s = r["seconds"]
        ratio = f"{s['total'] / ddp['seconds']['total']:.2f}x" if ddp else "-"
        lines.append(f"| {r['label']} | {s['total']:.4f} | {ratio} | {s['forward']:.4f} | {s['backward']:.4f} | "
                     f"{s['step']:.4f} | {r['tokens_per_s']:,.0f} | {', '.join(f'{x:.4f}' for x in r['rounds'])} |")
    return lines


def _memory(ran: list[dict]) -> list[str]:
    lines = ["", "## Memory per rank (rank 0, MB; the split: [Note: what compare measures] in "
             "zerodp/report/__init__.py)", "",
             "| framework | peak | " + " | ".join(CATEGORIES) + " | zerodp's estimate of the peak |",
             "|---" * (len(CATEGORIES) + 3) + "|"]
    for r in ran:
        cells = [format_megabytes(r["memory"].get(c)) for c in CATEGORIES]
        predicted = r["predicted_peak"]
        estimate = "-" if predicted is None or not r["peak"] else \
            f"{format_megabytes(predicted)} ({100 * (predicted / r['peak'] - 1):+.1f}%)"
        lines.append(f"| {r['label']} | {format_megabytes(r['peak'])} | {' | '.join(cells)} | {estimate} |")
    return lines


def _communication(ran: list[dict], nproc: int) -> list[str]:
    lines = ["", "## Communication per step (rank 0)", "",
             "Psi = parameters x the communicated dtype's bytes; the paper counts 2 Psi per rank and step (3 Psi at "
             f"stage 3), of which a ring sends (N - 1) / N = {nproc - 1}/{nproc} per rank.", "",
             "| framework | sent on the wire, MB | paper's volume, MB | x (N-1)/N, MB | wire / that | zerodp's ledger, MB |",
             "|---|---|---|---|---|---|"]
    for r in ran:
        wire, ring = r["bytes_written"], r["ring_bytes"]
        ratio = f"{wire / ring:.2f}" if wire is not None and ring else "-"
        lines.append(f"| {r['label']} | {format_megabytes(wire)} | {format_megabytes(r['paper_bytes'])} "
                     f"({FRAMEWORKS[r['framework']].paper_volume} Psi) | {format_megabytes(ring)} | {ratio} "
                     f"| {format_megabytes(r['ledger_comm_bytes'])} |")
    return lines


def _loss(ran: list[dict]) -> list[str]:
    ddp = _ddp_row(ran)
    lines = ["", "## Loss (rank 0, every step, the same data for every framework)", "",
             "| framework | first | last | largest difference from DDP's |", "|---|---|---|---|"]
    for r in ran:
        diff = "-" if ddp is None else f"{max(abs(a - b) for a, b in zip(r['losses'], ddp['losses'])):.3g}"
        lines.append(f"| {r['label']} | {r['losses'][0]:.6f} | {r['losses'][-1]:.6f} | {diff} |")
    return lines


def _step_reports(ran: list[dict]) -> list[str]:
    reports = [r for r in ran if r.get("step_report")]
    if not reports:
        return []
    lines = ["", "## zerodp's step reports (engine.step_report(), the last step of the first round)", "",
             "| framework | verdict | share | compute s | communication exposed s | overlapped s | optimizer s "
             "| offload transfers s |", "|---|---|---|---|---|---|---|---|"]
    for r in reports:
        rep = r["step_report"]
        lines.append(f"| {r['label']} | {rep['verdict']} | {100 * rep['share']:.0f}% | "
                     f"{rep['forward'] + rep['backward']:.4f} | {rep['communication_exposed']:.4f} | "
                     f"{rep['communication_overlapped']:.4f} | {rep['optimizer']:.4f} ({rep.get('optimizer_on', '')}) | "
                     f"{rep['offload_transfers']:.4f} |")
    return lines


def _plots(meta: dict) -> list[str]:
    plots = meta.get("plots") or []
    if plots:
        return ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    if meta.get("plots_missing"):
        return ["", f"No plots: {meta['plots_missing']}"]
    return []
