"""One rank of one launch of `zerodp compare`: a fresh spawned process that trains one framework and
puts its measurements on the parent's queue ([Note: what compare measures] in zerodp/report/__init__.py)."""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from zerodp.report.attribution import held_by_category
from zerodp.report.frameworks import FRAMEWORKS
from zerodp.report.runners import Runner, engine_runner, torch_runner


def socket_bytes_written() -> int | None:
    """Bytes this process has written through write calls so far (/proc/self/io's wchar; gloo sends
    over TCP through them), or None where /proc does not say."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def worker(rank: int, world: int, port: int, job: dict, queue: Any) -> None:
    """The spawned process of `rank`: joins the process group on `port`, trains `job`, puts (rank,
    result) on `queue`; a failure is a result {"error", "traceback"}, not an exception."""
    log = os.open(job["log"].format(rank=rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)  # the frameworks' warnings and the profiler's lines go to DIR/logs, not over the progress
    os.dup2(log, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", ZERODP_LOG_LEVEL="WARNING")
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = _device(rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=job["timeout"]))
    try:
        result = train(rank, job, device)
    except Exception as err:  # noqa: BLE001 - one framework's failure is a row of the report, not the end of it
        result = _failure(err)
        traceback.print_exc()
    queue.put((rank, result))
    if "error" not in result:
        dist.barrier()
        dist.destroy_process_group()


def _device(rank: int) -> Any:
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is imported, later
        return torch.device("cpu")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


def _failure(err: Exception) -> dict:
    """The error's one line (type, first line of the message, file:line where it was raised) and its traceback."""
    where = traceback.extract_tb(err.__traceback__)[-1]
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return {"error": f"{type(err).__name__}: {first} ({Path(where.filename).name}:{where.lineno})",
            "traceback": traceback.format_exc()}


def train(rank: int, job: dict, device: Any) -> dict:
    """One launch of one framework on this rank: the measurements of [Note: what compare measures]."""
    from zerodp.plan.workload import workload

    work = workload(job["model"])
    watch = _MemoryWatch(job["memory"], device.type == "cuda")
    try:
        runner = _build_runner(job, work, device)
        result = _run_steps(rank, job, work, runner, watch, device)
    finally:
        watch.close()
    if runner.engine is not None:
        result["step_report"] = runner.engine.step_report()
        result["ledger_comm_bytes"] = runner.engine.comm_report()["last_step"]["total_bytes"]
    return result


class _MemoryWatch:
    """The first round's memory on this rank: on the CPU the allocator's own trace from before the
    model is built through the warm-up steps (zerodp/plan/measure.py), on CUDA torch's counters."""

    def __init__(self, measure: bool, cuda: bool) -> None:
        from zerodp.plan.measure import AllocatorTrace

        self.measure, self.cuda = measure, cuda
        self.trace = AllocatorTrace().__enter__() if measure and not cuda else None
        if self.trace is not None:
            self.trace.mark("start")

    def after_warmup(self, runner: Runner, result: dict) -> None:
        """Into `result`: who holds what ("held"), the peak of live bytes so far and what is live now."""
        if not self.measure:
            return
        result["held"] = held_by_category(runner)
        if self.trace is not None:
            self.trace.mark("held")
            trace = self.trace
            self.close()  # the profiler's cost never reaches a timed step
            result["peak"], result["live"] = trace.peak_since("start"), trace.live_at("held")
        elif self.cuda:
            import torch

            result["peak"], result["live"] = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()

    def close(self) -> None:
        if self.trace is not None:
            self.trace.__exit__(None, None, None)
            self.trace = None


def _build_runner(job: dict, work: Any, device: Any) -> Runner:
    """The model from seed 0, wrapped by the job's framework."""
    import torch
    import torch.distributed as dist

    from zerodp import checkpointing

    fw = FRAMEWORKS[job["framework"]]
    torch.manual_seed(0)
    model = work.build()
    if fw.checkpointing:
        checkpointing.apply(model, "blocks")
    if fw.family in ("ddp", "fsdp2"):
        return torch_runner(fw, model, job["dtype"], device)
    return engine_runner(fw, model, job["dtype"], dist.get_world_size(), job["micro_batch"], job.get("config", {}))


def _run_steps(rank: int, job: dict, work: Any, runner: Runner, watch: _MemoryWatch, device: Any) -> dict:
    """The warm-up and timed steps: rank r's micro-batch of step i drawn from a generator seeded by i and r."""
    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result: dict = {}
    losses, timed, written = [], [], []
    for i in range(job["warmup"] + job["steps"]):
        if i == job["warmup"]:  # after the warm-up: the peak, and who holds what
            watch.after_warmup(runner, result)
        torch.manual_seed(1_000_003 * i + rank)
        args, kwargs = work.inputs(runner.model, job["micro_batch"], job["seq_len"], device)
        dist.barrier()
        loss, times, sent = _timed_step(runner, args, kwargs, sync)
        losses.append(float(loss.detach().float()))
        if i >= job["warmup"]:
            timed.append(times)
            if sent is not None and not cuda:
                written.append(sent)
        del loss, args, kwargs  # not live into the next step's measurement
    result.update(losses=losses, times=timed, bytes_written=written)
    return result


def _timed_step(runner: Runner, args: tuple, kwargs: dict, sync: Callable[[], None]) -> tuple[Any, dict, int | None]:
    """One step timed by the host clock, phase by phase: the loss, {forward, backward, step, total}
    seconds, and the bytes written to the sockets meanwhile (None where /proc does not say)."""
    before, start = socket_bytes_written(), time.perf_counter()
    loss = runner.forward(args, kwargs)
    sync()
    forward_done = time.perf_counter()
    runner.backward(loss)
    sync()
    backward_done = time.perf_counter()
    runner.step()
    sync()
    done, after = time.perf_counter(), socket_bytes_written()
    times = {"forward": forward_done - start, "backward": backward_done - forward_done, "step": done - backward_done,
             "total": done - start}
    return loss, times, after - before if before is not None and after is not None else None
