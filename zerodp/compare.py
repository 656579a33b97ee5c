"""`zerodp compare`: one model trained by torch DDP, FSDP2, DeepSpeed and zerodp's strategies, side by side.

    zerodp compare --out compare-demo                     # the demo's GPT, 2 ranks, every framework
    zerodp compare gpt:d_model=256,n_layer=6 --frameworks ddp,zerodp1,zerodp3 --rounds 3 --out cmp

Writes DIR/report.md (the tables and a verdict), DIR/results.json (every measurement), each
launch's output under DIR/logs/ and, with matplotlib installed, DIR/memory.png, DIR/step_time.png, DIR/communication.png and DIR/loss.png.

[Note: what compare measures]
Every framework trains in fresh processes (spawned; gloo on the CPU), one framework at a time, and
the frameworks are interleaved over rounds, so a slow spell of the machine falls on all of them
alike. Each launch builds the model from the same seed and trains `warmup` + `steps` optimizer steps
with the same AdamW, clipping at 1.0, on the same data (rank r's micro-batch of step i is drawn from
a generator seeded by i and r), one micro-batch per step.
- Step time: each timed step starts after a barrier; forward, backward and the optimizer step are
  timed on rank 0 by the host clock (on CUDA after a synchronize). The figure is the median over the
  timed steps of every round; tokens/s = micro-batch x sequence length x ranks / step time.
- Memory (the first round's launch only, so the profiler's cost never reaches a timed step): the
  CPU allocator's own accounting (zerodp/plan/measure.py's AllocatorTrace) from before the model is
  built through the warm-up steps gives the peak of live bytes on rank 0. After the last warm-up step
  the bytes then live are split by what holds them: zerodp's ledger for zerodp; for the others the
  storages of the parameters (FSDP2's local shards, DeepSpeed's partitions), of their `.grad`, and of
  the innermost torch optimizer's parameters that are not the model's (fp32 masters) and its state.
  "Other held" is the rest of what is live then (DDP's gradient buckets, module buffers, the batch);
  "transient" is peak minus held: activations saved for backward, gathered stage-3 parameters,
  communication buffers, temporaries. On CUDA, `torch.cuda.max_memory_allocated` gives the peak.
- Communication: the bytes rank 0 wrote to its sockets per timed step (/proc/self/io's wchar; gloo
  sends over TCP through write calls, so this is the traffic on the wire, whatever the framework),
  beside the ZeRO paper's volume per rank: 2 Psi per step for DDP and stages 0-2 (a reduce-scatter
  and an all-gather of Psi bytes, Psi = parameters x the communicated dtype's bytes), 3 Psi for
  stage 3 and resharding FSDP (one more all-gather, for backward). A ring collective over N ranks
  sends (N - 1) / N of that per rank, so the wire figure is compared with the paper's x (N - 1) / N.
  NCCL's traffic does not pass through the process's write calls: on CUDA the column stays empty.
- Loss: rank 0's loss at every step; at fp32 zerodp's stages match DDP's bitwise (tests/test_parity.py).
A framework that fails (not installed, an error, a rank that dies, a launch past --timeout) is
reported in the table with its reason; the rest of the report is still written.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
CATEGORIES = ("parameters", "gradients", "fp32 masters", "optimizer state", "other held", "transient")


@dataclass(frozen=True)
class Framework:
    """One way to train the model: its family ("ddp", "fsdp2", "deepspeed", "zerodp") and the ZeRO
    stage it amounts to (DDP 0; FSDP2 without resharding 2, with resharding 3)."""

    label: str
    family: str
    stage: int
    offload: bool = False
    checkpointing: bool = False

    @property
    def paper_volume(self) -> int:
        """Multiples of Psi the ZeRO paper counts per rank and step: 2, or 3 for stage 3."""
        return 3 if self.stage == 3 else 2


FRAMEWORKS = {
    "ddp": Framework("torch DDP", "ddp", 0),
    "fsdp2": Framework("FSDP2, reshard_after_forward=False", "fsdp2", 2),
    "fsdp2_3": Framework("FSDP2, reshard_after_forward=True", "fsdp2", 3),
    **{f"deepspeed{s}": Framework(f"DeepSpeed stage {s}", "deepspeed", s) for s in (1, 2, 3)},
    **{f"zerodp{s}": Framework(f"zerodp stage {s}", "zerodp", s) for s in (0, 1, 2, 3)},
    "zerodp2_offload": Framework("zerodp stage 2, optimizer offloaded to CPU", "zerodp", 2, offload=True),
    "zerodp2_ac": Framework("zerodp stage 2, blocks checkpointed", "zerodp", 2, checkpointing=True),
}


class CompareError(ValueError):
    """Bad input to `zerodp compare`, found before anything is launched."""


# --- one launch: the worker processes ---------------------------------------------------------------

def _socket_bytes_written() -> int | None:
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def _ds_config(fw: Framework, micro_batch: int, world: int, dtype: str) -> dict:
    zero: dict = {"stage": fw.stage}
    if fw.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    params = dict(ADAMW, betas=list(ADAMW["betas"]))
    if fw.family == "deepspeed":
        params["torch_adam"] = True  # no JIT-built CPU Adam: the same torch AdamW as the others
    config = {"train_batch_size": micro_batch * world, "train_micro_batch_size_per_gpu": micro_batch,
              "gradient_clipping": 1.0, "zero_optimization": zero, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": params}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


class _Runner:
    """forward(args, kwargs) -> loss, backward(loss), step(); and what holds the memory."""

    def __init__(self, forward: Callable, backward: Callable, step: Callable, model: Any, optimizer: Any,
                 engine: Any = None) -> None:
        self.forward, self.backward, self.step = forward, backward, step
        self.model, self.optimizer, self.engine = model, optimizer, engine


def _loss_of(out: Any) -> Any:
    return out if hasattr(out, "backward") else out.loss


def _torch_runner(fw: Framework, model: Any, dtype: str, device: Any) -> _Runner:
    import torch

    if fw.family == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model.to(device), device_ids=[device] if device.type == "cuda" else None)
        autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if dtype == "bf16" else contextlib.nullcontext
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from zerodp.checkpointing import repeated_blocks

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dtype == "bf16" else MixedPrecisionPolicy()
        model.to(device)
        for _, block in repeated_blocks(model):
            fully_shard(block, reshard_after_forward=fw.stage == 3, mp_policy=policy)
        wrapped = fully_shard(model, reshard_after_forward=fw.stage == 3, mp_policy=policy)
        autocast = contextlib.nullcontext  # mixed precision is FSDP2's policy, not autocast
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW, foreach=True)

    def forward(args: tuple, kwargs: dict) -> Any:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            return _loss_of(wrapped(*args, **kwargs))

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return _Runner(forward, lambda loss: loss.backward(), step, model, optimizer)


def _engine_runner(fw: Framework, model: Any, dtype: str, world: int, micro_batch: int, overrides: dict) -> _Runner:
    config = _ds_config(fw, micro_batch, world, dtype)
    for key, value in overrides.items():  # a section's keys join the section's; any other key replaces
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    if fw.family == "deepspeed":
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
    else:
        import zerodp

        engine, *_ = zerodp.initialize(model=model, config=config)
    return _Runner(lambda args, kwargs: _loss_of(engine(*args, **kwargs)), engine.backward, engine.step,
                   engine.module, engine.optimizer, engine if fw.family == "zerodp" else None)


def _storage_bytes(tensors: Any) -> dict[tuple, int]:
    """{storage key: bytes} of each distinct storage behind `tensors` (views of one buffer count once)."""
    out = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensor: this rank's shard
        storage = t.untyped_storage()
        if storage.nbytes():
            out[(storage.data_ptr(), str(t.device))] = storage.nbytes()
    return out


def held_by_category(runner: _Runner) -> dict[str, int]:
    """Bytes held after a step by parameters, gradients, fp32 masters and optimizer state, on this rank."""
    if runner.engine is not None:  # zerodp: its own ledger, every tier (on a CPU-only machine all are RAM)
        held = runner.engine.memory_report()["held"]
        total = lambda category: sum(held.get(category, {}).values())
        masters = total("param32_master")
        working = total("param16")
        if not working:  # fp32: the device's masters are the parameters; an offloaded copy is a master
            working = held.get("param32_master", {}).get("device", 0)
            masters -= working
        return {"parameters": working + total("param_secondary"), "gradients": total("grad"),
                "fp32 masters": masters, "optimizer state": total("optim_state")}
    import torch

    inner = runner.optimizer
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer  # DeepSpeed's ZeRO optimizers wrap a torch one
    model_params = list(runner.model.parameters())
    params = _storage_bytes([getattr(p, "ds_tensor", None) for p in model_params] + model_params)
    opt_params = [p for group in inner.param_groups for p in group["params"]]
    grads = _storage_bytes([p.grad for p in model_params + opt_params])
    masters = {k: b for k, b in _storage_bytes(opt_params).items() if k not in params}
    state = _storage_bytes(v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    seen: set = set()

    def count(storages: dict) -> int:
        fresh = {k: b for k, b in storages.items() if k not in seen}
        seen.update(fresh)
        return sum(fresh.values())

    return {"parameters": count(params), "gradients": count(grads), "fp32 masters": count(masters),
            "optimizer state": count(state)}


def _worker(rank: int, world: int, port: int, job: dict, queue: Any) -> None:
    log = os.open(job["log"].format(rank=rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)  # the frameworks' warnings and the profiler's lines go to DIR/logs, not over the progress
    os.dup2(log, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", ZERODP_LOG_LEVEL="WARNING")
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is imported, later
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=job["timeout"]))
    try:
        result = _train(rank, job, device)
    except Exception as err:  # noqa: BLE001 - one framework's failure is a row of the report, not the end of it
        where = traceback.extract_tb(err.__traceback__)[-1]
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        result = {"error": f"{type(err).__name__}: {first} ({Path(where.filename).name}:{where.lineno})",
                  "traceback": traceback.format_exc()}
        traceback.print_exc()
    queue.put((rank, result))
    if "error" not in result:
        dist.barrier()
        dist.destroy_process_group()


def _train(rank: int, job: dict, device: Any) -> dict:
    """One launch of one framework on this rank: the measurements of [Note: what compare measures]."""
    import torch
    import torch.distributed as dist

    from zerodp import checkpointing
    from zerodp.plan.estimate import workload
    from zerodp.plan.measure import AllocatorTrace

    fw, cuda = FRAMEWORKS[job["framework"]], device.type == "cuda"
    work = workload(job["model"])
    trace = AllocatorTrace().__enter__() if job["memory"] and not cuda else None
    result: dict = {}
    try:
        if trace is not None:
            trace.mark("start")
        torch.manual_seed(0)
        model = work.build()
        if fw.checkpointing:
            checkpointing.apply(model, "blocks")
        if fw.family in ("ddp", "fsdp2"):
            runner = _torch_runner(fw, model, job["dtype"], device)
        else:
            runner = _engine_runner(fw, model, job["dtype"], dist.get_world_size(), job["micro_batch"],
                                    job.get("config", {}))
        del model
        losses, timed, written = [], [], []
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for i in range(job["warmup"] + job["steps"]):
            if i == job["warmup"] and job["memory"]:  # after the warm-up: the peak, and who holds what
                result["held"] = held_by_category(runner)
                if trace is not None:
                    trace.mark("held")
                    trace.__exit__(None, None, None)
                    result["peak"], result["live"] = trace.peak_since("start"), trace.live_at("held")
                    trace = None
                elif cuda:
                    result["peak"], result["live"] = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
            torch.manual_seed(1_000_003 * i + rank)
            args, kwargs = work.inputs(runner.model, job["micro_batch"], job["seq_len"], device)
            dist.barrier()
            before, start = _socket_bytes_written(), time.perf_counter()
            loss = runner.forward(args, kwargs)
            sync()
            forward_done = time.perf_counter()
            runner.backward(loss)
            sync()
            backward_done = time.perf_counter()
            runner.step()
            sync()
            done, after = time.perf_counter(), _socket_bytes_written()
            losses.append(float(loss.detach().float()))
            if i >= job["warmup"]:
                timed.append({"forward": forward_done - start, "backward": backward_done - forward_done,
                              "step": done - backward_done, "total": done - start})
                if before is not None and after is not None and not cuda:
                    written.append(after - before)
            del loss, args, kwargs
    finally:
        if trace is not None:
            trace.__exit__(None, None, None)
    result.update(losses=losses, times=timed, bytes_written=written)
    if runner.engine is not None:
        result["step_report"] = runner.engine.step_report()
        result["ledger_comm_bytes"] = runner.engine.comm_report()["last_step"]["total_bytes"]
    return result


# --- the parent: launches, rounds, the report ------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(job: dict, nproc: int) -> dict:
    """Train `job` on `nproc` fresh processes: rank 0's result, or {"error": why} when any rank failed,
    died or ran past the job's timeout (the other ranks are then stopped: nothing is left hanging)."""
    import queue as queue_module

    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").Queue()
    procs = mp.start_processes(_worker, args=(nproc, _free_port(), job, queue), nprocs=nproc, join=False,
                               start_method="spawn")
    results: dict[int, dict] = {}
    deadline, failure = time.monotonic() + job["timeout"], None
    while len(results) < nproc and failure is None:
        try:
            rank, result = queue.get(timeout=0.5)
            results[rank] = result
            failure = result.get("error") and f"rank {rank}: {result['error']}"
        except queue_module.Empty:
            gone = [r for r, p in enumerate(procs.processes) if p.exitcode is not None and r not in results]
            if gone:
                failure = f"rank {gone[0]} exited with code {procs.processes[gone[0]].exitcode} before reporting"
            elif time.monotonic() > deadline:
                failure = f"no result after --timeout {job['timeout']} s"
    for p in procs.processes:
        p.join(timeout=30 if failure is None else 2)
        if p.is_alive():
            p.kill()
            p.join()
    if failure is not None:
        tb = next((r["traceback"] for r in results.values() if "error" in r), "")
        return {"error": f"{failure} (its output: {job['log'].format(rank='*')})", "traceback": tb}
    return results[0]


def _psi_bytes(fw: Framework, params: int, dtype: str) -> int:
    """Psi: the bytes of one copy of the gradients as the framework communicates them."""
    sixteen = dtype == "bf16" and fw.family != "ddp"  # DDP under autocast keeps (and reduces) fp32 gradients
    return params * (2 if sixteen else 4)


def _predicted_peak(fw: Framework, spec: str, nproc: int, micro_batch: int, seq_len: int, dtype: str) -> int | None:
    """zerodp's estimate of this run's peak on rank 0 (its own strategies, on the device, without offload)."""
    if fw.family != "zerodp" or fw.offload:
        return None
    try:
        from zerodp.plan.estimate import Strategy, workload
        from zerodp.plan.simulate import simulate_strategy

        sim = simulate_strategy(workload(spec), Strategy(fw.stage, dtype=dtype), nproc, micro_batch, seq_len,
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
    psi = _psi_bytes(fw, params, dtype)
    row.update(seconds=phases, rounds=[statistics.median(t["total"] for t in l["times"]) for l in launches],
               tokens_per_s=micro_batch * seq_len * nproc / phases["total"], memory=memory, peak=first.get("peak"),
               predicted_peak=_predicted_peak(fw, spec, nproc, micro_batch, seq_len, dtype),
               bytes_written=statistics.median(written) if written else None,
               paper_bytes=fw.paper_volume * psi, ring_bytes=fw.paper_volume * psi * (nproc - 1) // nproc,
               ledger_comm_bytes=first.get("ledger_comm_bytes"), losses=first["losses"],
               step_report=first.get("step_report"))
    return row


def verdict(rows: list[dict], nproc: int, tie: float = 0.05) -> str:
    """The report's one paragraph: which to use on this model and these ranks, and why."""
    ran = [r for r in rows if "error" not in r]
    if not ran:
        return "No framework ran; see the table for each one's reason."
    fastest = min(ran, key=lambda r: r["seconds"]["total"])
    with_peak = [r for r in ran if r.get("peak")]
    near = [r for r in with_peak if r["seconds"]["total"] <= fastest["seconds"]["total"] * (1 + tie)] or [fastest]
    best = min(near, key=lambda r: r["peak"]) if with_peak else fastest
    ddp = next((r for r in ran if r["framework"] == "ddp"), None)
    vs = lambda r: f"{r['seconds']['total'] / ddp['seconds']['total']:.2f}x DDP's step time" if ddp else \
        f"{r['seconds']['total']:.3f} s/step"
    mb = lambda r: f"{r['peak'] / 1e6:.1f} MB"
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
    from zerodp.sizes import format_megabytes

    ran = [r for r in rows if "error" not in r]
    ddp = next((r for r in ran if r["framework"] == "ddp"), None)
    lines = [f"# zerodp compare: {meta['model']}", "",
             f"{meta['params'] / 1e6:.2f}M parameters, micro-batch {meta['micro_batch']} x {meta['seq_len']} tokens, "
             f"{meta['nproc']} ranks ({meta['device']}), {meta['dtype']}, {meta['rounds']} rounds x {meta['steps']} timed "
             f"steps after {meta['warmup']} warm-up steps; torch {meta['torch']}, {meta['date']}.", "",
             f"    {meta['command']}", "", "## Verdict", "", verdict(rows, meta["nproc"]), "",
             "## Step time (rank 0, median of the timed steps)", "",
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
    lines += ["", "## Memory per rank (rank 0, MB; the split: [Note: what compare measures] in zerodp/compare.py)", "",
              "| framework | peak | " + " | ".join(CATEGORIES) + " | zerodp's estimate of the peak |",
              "|---" * (len(CATEGORIES) + 3) + "|"]
    for r in ran:
        cells = [format_megabytes(r["memory"].get(c)) for c in CATEGORIES]
        predicted = r["predicted_peak"]
        estimate = "-" if predicted is None or not r["peak"] else \
            f"{format_megabytes(predicted)} ({100 * (predicted / r['peak'] - 1):+.1f}%)"
        lines.append(f"| {r['label']} | {format_megabytes(r['peak'])} | {' | '.join(cells)} | {estimate} |")
    lines += ["", "## Communication per step (rank 0)", "",
              "Psi = parameters x the communicated dtype's bytes; the paper counts 2 Psi per rank and step (3 Psi at "
              f"stage 3), of which a ring sends (N - 1) / N = {meta['nproc'] - 1}/{meta['nproc']} per rank.", "",
              "| framework | sent on the wire, MB | paper's volume, MB | x (N-1)/N, MB | wire / that | zerodp's ledger, MB |",
              "|---|---|---|---|---|---|"]
    for r in ran:
        wire, ring = r["bytes_written"], r["ring_bytes"]
        ratio = f"{wire / ring:.2f}" if wire is not None and ring else "-"
        lines.append(f"| {r['label']} | {format_megabytes(wire)} | {format_megabytes(r['paper_bytes'])} ({FRAMEWORKS[r['framework']].paper_volume} Psi) "
                     f"| {format_megabytes(ring)} | {ratio} | {format_megabytes(r['ledger_comm_bytes'])} |")
    lines += ["", "## Loss (rank 0, every step, the same data for every framework)", "",
              "| framework | first | last | largest difference from DDP's |", "|---|---|---|---|"]
    for r in ran:
        diff = "-" if ddp is None else f"{max(abs(a - b) for a, b in zip(r['losses'], ddp['losses'])):.3g}"
        lines.append(f"| {r['label']} | {r['losses'][0]:.6f} | {r['losses'][-1]:.6f} | {diff} |")
    reports = [r for r in ran if r.get("step_report")]
    if reports:
        lines += ["", "## zerodp's step reports (engine.step_report(), the last step of the first round)", "",
                  "| framework | verdict | share | compute s | communication exposed s | overlapped s | optimizer s "
                  "| offload transfers s |", "|---|---|---|---|---|---|---|---|"]
        for r in reports:
            rep = r["step_report"]
            lines.append(f"| {r['label']} | {rep['verdict']} | {100 * rep['share']:.0f}% | "
                         f"{rep['forward'] + rep['backward']:.4f} | {rep['communication_exposed']:.4f} | "
                         f"{rep['communication_overlapped']:.4f} | {rep['optimizer']:.4f} ({rep.get('optimizer_on', '')}) | "
                         f"{rep['offload_transfers']:.4f} |")
    plots = meta.get("plots") or []
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    elif meta.get("plots_missing"):
        lines += ["", f"No plots: {meta['plots_missing']}"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


def draw_plots(out: Path, rows: list[dict]) -> list[str]:
    """memory.png, step_time.png, communication.png, loss.png; the names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if "error" not in r]
    labels = [r["label"] for r in ran]
    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    def stacked(ax: Any, parts: list[str], value: Callable[[dict, str], float], unit: str) -> None:
        left = [0.0] * len(ran)
        for part in parts:
            widths = [value(r, part) for r in ran]
            ax.barh(labels, widths, left=left, label=part)
            left = [a + b for a, b in zip(left, widths)]
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))

    height = 0.45 * len(ran) + 1.5
    with_memory = [r for r in ran if r.get("peak")]
    if with_memory:
        fig, ax = plt.subplots(figsize=(10, height))
        stacked(ax, list(CATEGORIES), lambda r, c: r["memory"].get(c, 0) / 1e6, "MB per rank at the peak (rank 0)")
        ax.set_title("Peak memory by category")
        peaks = sorted(r["peak"] / 1e6 for r in with_memory)
        typical = peaks[len(peaks) // 2]
        if peaks[-1] > 5 * typical:  # one framework's peak would flatten the rest: cut the axis, label it
            limit = 1.3 * max(p for p in peaks if p <= 5 * typical)
            ax.set_xlim(0, limit)
            for y, r in enumerate(ran):
                if r.get("peak") and r["peak"] / 1e6 > limit:
                    ax.text(limit * 0.98, y, f"{r['peak'] / 1e6:,.0f} MB, off the scale", ha="right", va="center",
                            fontsize=8, color="white")
        save(fig, "memory.png")
    fig, ax = plt.subplots(figsize=(10, height))
    stacked(ax, ["forward", "backward", "step"], lambda r, p: r["seconds"][p], "seconds per step (median, rank 0)")
    ax.set_title("Step time: forward, backward (with its communication), optimizer step")
    save(fig, "step_time.png")
    fig, ax = plt.subplots(figsize=(10, height))
    ys = range(len(ran))
    ax.barh([y - 0.2 for y in ys], [(r["bytes_written"] or 0) / 1e6 for r in ran], height=0.4, label="sent on the wire")
    ax.barh([y + 0.2 for y in ys], [r["ring_bytes"] / 1e6 for r in ran], height=0.4, label="paper's volume x (N-1)/N")
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xlabel("MB per rank and step")
    ax.set_title("Communication per step")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    save(fig, "communication.png")
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
    save(fig, "loss.png")
    return written


def parse_frameworks(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown or not names:
        raise CompareError(f"--frameworks: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                           f"choose from {', '.join(FRAMEWORKS)}")
    return names


def compare(model: str, out: Path, frameworks: list[str], nproc: int = 2, steps: int = 10, rounds: int = 3,
            warmup: int = 2, micro_batch: int = 8, seq_len: int | None = None, dtype: str = "fp32",
            timeout: int = 600, command: str = "", progress: Callable[[str], None] = print) -> list[dict]:
    """Run every framework of `frameworks` on `model` and write `out`/report.md (+ results.json, PNGs)."""
    import datetime

    import torch

    from zerodp.plan.estimate import workload

    work = workload(model)
    if work.inputs is None:
        raise CompareError(f"MODEL {model!r}: zerodp does not know this model's input; give the module an "
                           "`estimate_inputs(micro_batch, seq_len)` method returning (args, kwargs)")
    if warmup < 2:
        raise CompareError(f"--warmup {warmup}: at least 2 (memory is measured through the warm-up steps, and the "
                           "peak comes in the second, the first with optimizer state)")
    seq_len = seq_len or min(work.max_seq_len or 128, 128)
    if work.max_seq_len and seq_len > work.max_seq_len:
        raise CompareError(f"--seq-len {seq_len}: the model takes at most {work.max_seq_len} tokens")
    with torch.device("meta"):
        params = sum(p.numel() for p in work.build().parameters() if p.requires_grad)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib  # noqa: F401
        plots_missing = None
    except ImportError:
        plots_missing = "matplotlib is not installed (pip install matplotlib, or zerodp's [plots] extra)"
        progress(f"note: {plots_missing}; report.md is written without plots")
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    launches: dict[str, list[dict]] = {n: [] for n in frameworks}
    runnable = [n for n in frameworks if FRAMEWORKS[n].family != "deepspeed" or has_deepspeed]
    for n in set(frameworks) - set(runnable):
        launches[n].append({"error": "deepspeed is not installed (pip install deepspeed)"})
    total, k = len(runnable) * rounds, 0
    for round_ in range(rounds):
        for name in runnable:
            k += 1
            if any("error" in l for l in launches[name]):
                continue  # failed once: the same error again would only cost time
            job = {"framework": name, "model": model, "micro_batch": micro_batch, "seq_len": seq_len, "dtype": dtype,
                   "steps": steps, "warmup": warmup, "memory": round_ == 0, "timeout": timeout,
                   "log": str(out / "logs" / f"{name}-round{round_ + 1}-rank{{rank}}.log")}
            started = time.monotonic()
            result = _launch(job, nproc)
            launches[name].append(result)
            took = time.monotonic() - started
            if "error" in result:
                progress(f"[{k}/{total}] round {round_ + 1}/{rounds}: {FRAMEWORKS[name].label}: FAILED ({took:.0f} s): "
                         f"{result['error']}")
            else:
                step = statistics.median(t["total"] for t in result["times"])
                progress(f"[{k}/{total}] round {round_ + 1}/{rounds}: {FRAMEWORKS[name].label}: {step:.4f} s/step "
                         f"({took:.0f} s)")
    rows = [summarize(n, launches[n], model, params, nproc, micro_batch, seq_len, dtype) for n in frameworks]
    meta = {"model": model, "params": params, "nproc": nproc, "micro_batch": micro_batch, "seq_len": seq_len,
            "dtype": dtype, "steps": steps, "rounds": rounds, "warmup": warmup, "torch": torch.__version__,
            "device": "CUDA" if torch.cuda.is_available() else "CPU, gloo",
            "date": datetime.date.today().isoformat(), "command": command, "plots_missing": plots_missing}
    if plots_missing is None and any("error" not in r for r in rows):
        meta["plots"] = draw_plots(out, rows)
    write_report(out, rows, meta)
    return rows
