"""One row of `zerodp compare`'s report: a framework's launches summed up, beside the ZeRO paper's
communication volume and zerodp's own estimate of the peak."""

from __future__ import annotations

import statistics

from zerodp.report.frameworks import FRAMEWORKS, Framework


def psi_bytes(fw: Framework, params: int, dtype: str) -> int:
    """Psi: the bytes of one copy of the gradients as the framework communicates them."""
    sixteen = dtype == "bf16" and fw.family != "ddp"  # DDP under autocast keeps (and reduces) fp32 gradients
    return params * (2 if sixteen else 4)


def predicted_peak(fw: Framework, spec: str, nproc: int, micro_batch: int, seq_len: int, dtype: str) -> int | None:
    """zerodp's estimate of this run's peak on rank 0 (its own strategies, on the device, without offload)."""
    if fw.family != "zerodp" or fw.offload:
        return None
    try:
        from zerodp.plan.model_states import StrategySpec
        from zerodp.plan.workload import workload
        from zerodp.plan.simulate import simulate_strategy

        sim = simulate_strategy(workload(spec), StrategySpec(fw.stage, dtype=dtype), nproc, micro_batch, seq_len,
                                "blocks" if fw.checkpointing else "none", device="cpu")
        return sim.peak["device"].bytes
    except Exception:  # noqa: BLE001 - the estimate is a column beside the measurement, never the run's end
        return None


def summarize(name: str, launches: list[dict], spec: str, params: int, nproc: int, micro_batch: int, seq_len: int,
              dtype: str) -> dict:
    """One row of the report: the launches' measurements together."""
    fw = FRAMEWORKS[name]
    row: dict = {"framework": name, "label": fw.label}
    errors = [l["error"] for l in launches if "error" in l]
    if errors or not launches:
        return {**row, "error": errors[0] if errors else "not run"}
    times = [t for l in launches for t in l["times"]]
    phases = {k: statistics.median(t[k] for t in times) for k in ("forward", "backward", "step", "total")}
    first = launches[0]
    memory = dict(first.get("held", {}))
    if "peak" in first:
        memory["other held"] = max(first["live"] - sum(memory.values()), 0)
        memory["transient"] = max(first["peak"] - first["live"], 0)
    written = [b for l in launches for b in l["bytes_written"]]
    psi = psi_bytes(fw, params, dtype)
    row.update(seconds=phases, rounds=[statistics.median(t["total"] for t in l["times"]) for l in launches],
               tokens_per_s=micro_batch * seq_len * nproc / phases["total"], memory=memory, peak=first.get("peak"),
               predicted_peak=predicted_peak(fw, spec, nproc, micro_batch, seq_len, dtype),
               bytes_written=statistics.median(written) if written else None,
               paper_bytes=fw.paper_volume * psi, ring_bytes=fw.paper_volume * psi * (nproc - 1) // nproc,
               ledger_comm_bytes=first.get("ledger_comm_bytes"), losses=first["losses"],
               step_report=first.get("step_report"))
    return row
