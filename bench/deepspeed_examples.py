"""DeepSpeedExamples' training examples, unchanged, on zerodp (ZERODP_AS_DEEPSPEED=1): which run, which are refused.

    python bench/deepspeed_examples.py --examples ~/src/DeepSpeedExamples \\
        [--python /work/benchvenv/bin/python] [--variants dschat-s1-z2,...] [--real-deepspeed] [--timeout 300] \\
        [--cifar-data DIR]

Each variant is one example script of a DeepSpeedExamples checkout (--examples; never written to: the
example's folder is copied into the work folder first, since the scripts write beside themselves), started
as its README starts it (the `deepspeed` launcher: zerodp's `zerodp deepspeed`, --num_gpus 2, i.e. 2 CPU
processes), one at a time, under `nice -n 10`, with a timeout. The settings a variant differs in are those
of the example's own shipped run scripts (ZeRO stage, LoRA, offload, gradient checkpointing); sizes are made
tiny through the script's own flags, and the model and data are local (tests/framework_inputs.py: a tiny
Llama and a tokenizer trained on local text), exactly as bench/frameworks.py runs DeepSpeed-Chat (with its
CHAT_PATCHES for transformers 5, applied to the copy). Nothing reaches a hub.

It prints, per variant: ran (exit 0) / refused (zerodp named a feature it lacks) / failed (the first error
line) / not run (what the machine lacks), the wall time and the final loss where the script prints one.
--real-deepspeed runs each also with the real DeepSpeed of --python (DS_ACCELERATOR=cpu).

The CUDA shim: training/bf16_master_weight/train.py calls torch.cuda.set_device(local_rank) and
torch.cuda.reset_peak_memory_stats() unconditionally, and a CPU build of torch raises AttributeError at
both. Where --python's torch has no CUDA, its two variants run "with the CUDA shim" (CUDA_SHIM below): a
sitecustomize.py put first on PYTHONPATH for these variants only, the same for zerodp and for DeepSpeed,
that makes exactly those two functions no-ops and then runs the run's own sitecustomize (zerodp's switch,
or the DeepSpeed comm start). The script file stays unchanged. Its torch.cuda.manual_seed_all(seed) needs
nothing (a CPU build queues it for a CUDA start that never comes), and its
torch.autocast(device_type="cuda", ...) around forward and loss is disabled by torch itself (a warning) on
both sides, so what autocasts is the engine's own `torch_autocast` section (the engine's forward only,
not the script's loss).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.framework_jobs import CHAT, CHAT_STEPS, _chat_copy, chat_args, chat_command, chat_curves  # noqa: E402
from bench.frameworks import environment  # noqa: E402
from tests.framework_inputs import make_inputs  # noqa: E402

TRAINING = Path("training")


@dataclass
class Variant:
    name: str
    settings: str
    folder: Path
    """The example's folder in the checkout; the run's working directory is its copy."""
    script: str
    arguments: Callable[[dict, Path], list[str]]
    """(local inputs, the run's folder) -> the script's command-line arguments."""
    loss: Callable[[str], float | None]
    """The final loss the script printed (None where it prints none)."""
    needs: Callable[[argparse.Namespace], str | None] = lambda args: None
    """What a machine lacks to run it (None when it can run), given the bench's arguments."""
    curve: Callable[[str], dict[int, float]] | None = None
    """The per-step losses the script prints (compared with --real-deepspeed), where it prints them."""
    cuda_shim: bool = False
    """Run with CUDA_SHIM where --python's torch has no CUDA (the module docstring says why)."""


def _python_can(python: str, code: str) -> bool:
    return subprocess.run([python, "-c", code], capture_output=True).returncode == 0


def _needs_torchvision(args: argparse.Namespace) -> str | None:
    if _python_can(args.python, "import torchvision"):
        return None
    return f"torchvision (the script imports it) does not import in {args.python}"


CUDA_SHIM = '''"""bench/deepspeed_examples.py's CUDA shim (its module docstring says why): without CUDA, the two
torch.cuda calls train.py makes unconditionally and a CPU build of torch raises at become no-ops; then
the run's own sitecustomize (next on the path) runs."""
import importlib.machinery
import importlib.util
import os
import sys

import torch

if not torch.cuda.is_available():
    def _no_cuda(*args, **kwargs):
        return None

    torch.cuda.set_device = _no_cuda
    torch.cuda.reset_peak_memory_stats = _no_cuda

_HERE = os.path.dirname(os.path.abspath(__file__))
_NEXT = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE])
if _NEXT is not None:
    _NEXT.loader.exec_module(importlib.util.module_from_spec(_NEXT))
'''
"""Written as sitecustomize.py into a folder put first on PYTHONPATH (shim_path)."""


def shim_path(run: Path) -> str:
    """The folder holding CUDA_SHIM as sitecustomize.py, written under the run's folder."""
    folder = run / "cuda-shim"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(CUDA_SHIM)
    return str(folder)


def _needs_cifar(args: argparse.Namespace) -> str | None:
    if args.cifar_data is None or not (args.cifar_data / "cifar-10-batches-py").is_dir():
        return ("--cifar-data (a folder holding the real cifar-10-batches-py): the script calls torchvision's "
                "CIFAR10(root='./data', download=True), which checks the files' md5 sums, so a generated stand-in "
                "would be replaced by a download")
    return _needs_torchvision(args)


def _needs_hub(what: str) -> Callable[[argparse.Namespace], str | None]:
    return lambda args: f"{what} from the Hugging Face hub (the script has no argument for a local copy)"


def _sft(flags: list[str]) -> Callable[[dict, Path], list[str]]:
    """DeepSpeed-Chat step 1 (bench/framework_jobs.py's one-epoch settings), then the variant's flags: argparse
    keeps the last of a repeated option, so `--zero_stage N` here replaces the default's."""
    def arguments(inputs: dict, run: Path) -> list[str]:
        return [*chat_args("dschat_sft", inputs, run / "output", run / "data-cache"), *flags]
    return arguments


def _rm(flags: list[str]) -> Callable[[dict, Path], list[str]]:
    def arguments(inputs: dict, run: Path) -> list[str]:
        return [*chat_args("dschat_rm", inputs, run / "output", run / "data-cache"), *flags]
    return arguments


def _sft_loss(log: str) -> float | None:
    """The evaluation loss step 1 prints after the epoch (`ppl: P, loss: L`); else the last training loss."""
    found = re.findall(r"ppl: [-0-9.e]+, loss: ([-0-9.e]+)", log)
    if found:
        return float(found[-1])
    curve = chat_curves("dschat_sft", log)
    return curve[max(curve)] if curve else None


def _sft_curve(log: str) -> dict[int, float]:
    """Step 1's per-micro-batch training losses, both ranks (`--print_loss`)."""
    return chat_curves("dschat_sft", log)


def _rm_loss(log: str) -> float | None:
    found = re.findall(r"Epoch 1/1 with loss ([-0-9.e]+)", log)
    return float(found[-1]) if found else None


def _cifar_loss(log: str) -> float | None:
    """The last running mean cifar10_deepspeed.py prints (`[ 1,  2000] loss:  1.234`, every --log-interval)."""
    found = re.findall(r"\]\s+loss:\s+([-0-9.e]+)", log)
    return float(found[-1]) if found else None


def _no_loss(log: str) -> float | None:
    return None


def _offload_states(flags: list[str]) -> Callable[[dict, Path], list[str]]:
    return lambda inputs, run: ["--hidden_dim", "64", "--nlayers", "2", "--iteration", "6", "--warmup", "2", *flags]


def _cifar(stage: int, dtype: str) -> Callable[[dict, Path], list[str]]:
    return lambda inputs, run: ["--deepspeed", "--epochs", "1", "--stage", str(stage), "--dtype", dtype]


def _bf16(config: str) -> Callable[[dict, Path], list[str]]:
    """train.py's own flags, tiny: one layer of width 32, 6 steps of 2 x 16 tokens, every step's loss printed."""
    return lambda inputs, run: ["--deepspeed_config", f"configs/{config}", "--num_layers", "1", "--hidden_dim", "32",
                                "--num_heads", "2", "--vocab_size", "128", "--batch_size", "2", "--seq_length", "16",
                                "--num_steps", "6", "--warmup_steps", "1", "--log_interval", "1"]


def _bf16_curve(log: str) -> dict[int, float]:
    """Each step's loss train.py prints (`[Rank R] Step S: loss=L`, 4 decimals), ranks 0 and 1 as 2S and 2S+1."""
    found = re.findall(r"\[Rank (\d+)\] Step (\d+): loss=([-0-9.e]+)", log)
    return {2 * int(step) + int(rank): float(loss) for rank, step, loss in found}


def _bf16_loss(log: str) -> float | None:
    """Rank 0's last step loss."""
    curve = _bf16_curve(log)
    last = max((key for key in curve if key % 2 == 0), default=None)
    return None if last is None else curve[last]


_STEP1 = CHAT / "training" / CHAT_STEPS["dschat_sft"]
_STEP2 = CHAT / "training" / CHAT_STEPS["dschat_rm"]
_LORA = ["--lora_dim", "8", "--lora_module_name", "layers."]


def _step1(name: str, settings: str, flags: list[str]) -> Variant:
    """A DeepSpeed-Chat step-1 variant: main.py with the flags of the shipped run script `settings` names."""
    return Variant(name, settings, _STEP1, "main.py", _sft(flags), _sft_loss, curve=_sft_curve)


VARIANTS = [
    # DeepSpeed-Chat step 1 (training_scripts/ of step1_supervised_finetuning): the six combinations of the
    # settings DeepSpeed acts on that its run scripts ship; LoRA's rank 128 becomes 8 for the tiny model
    _step1("dschat-s1-z0-lora", "opt/single_gpu/run_1.3b.sh: ZeRO-0, LoRA", ["--zero_stage", "0", *_LORA]),
    _step1("dschat-s1-z0-lora-only", "opt/single_node/run_1.3b_lora.sh: ZeRO-0, LoRA, only_optimize_lora",
           ["--zero_stage", "0", *_LORA, "--only_optimize_lora"]),
    _step1("dschat-s1-z2", "opt/single_node/run_1.3b.sh: ZeRO-2", ["--zero_stage", "2"]),
    _step1("dschat-s1-z2-offload-lora-only", "opt/single_node/sweep/run_single.sh: ZeRO-2, --offload, LoRA, "
           "only_optimize_lora", ["--zero_stage", "2", "--offload", *_LORA, "--only_optimize_lora"]),
    _step1("dschat-s1-z3-gc", "llama2/run_llama2_7b.sh: ZeRO-3, gradient checkpointing",
           ["--zero_stage", "3", "--gradient_checkpointing"]),
    _step1("dschat-s1-z3-gc-lora", "llama2/run_llama2_7b_lora.sh: ZeRO-3, gradient checkpointing, LoRA",
           ["--zero_stage", "3", "--gradient_checkpointing", *_LORA]),
    # DeepSpeed-Chat step 2 (reward model): its opt/single_node/run_350m.sh default (ZeRO-0) and its llama2 (ZeRO-3)
    Variant("dschat-s2-z0", "opt/single_node/run_350m.sh: ZeRO-0", _STEP2, "main.py", _rm(["--zero_stage", "0"]),
            _rm_loss),
    Variant("dschat-s2-z3", "llama2/run_llama2_7b.sh: ZeRO-3", _STEP2, "main.py", _rm(["--zero_stage", "3"]),
            _rm_loss),
    # training/offload_states: ZeRO-3 bf16, offload_states()/reload_states() after every step
    Variant("offload-states-all", "offload_states.py: ZeRO-3, bf16, offload every state", TRAINING / "offload_states",
            "offload_states.py", _offload_states([]), _no_loss),
    Variant("offload-states-optim", "offload_states.py: ZeRO-3, bf16, --included_state optim_states",
            TRAINING / "offload_states", "offload_states.py", _offload_states(["--included_state", "optim_states"]),
            _no_loss),
    # training/bf16_master_weight: run_comparison.sh's two configs
    Variant("bf16-master-baseline", "configs/baseline.json: ZeRO-3, bf16, fp32 masters",
            TRAINING / "bf16_master_weight", "train.py", _bf16("baseline.json"), _bf16_loss, curve=_bf16_curve,
            cuda_shim=True),
    Variant("bf16-master-full", "configs/bf16_full.json: ZeRO-3, bf16 masters and optimizer states, torch_autocast",
            TRAINING / "bf16_master_weight", "train.py", _bf16("bf16_full.json"), _bf16_loss, curve=_bf16_curve,
            cuda_shim=True),
    # training/cifar: cifar10_deepspeed.py's own --stage/--dtype flags (run_ds.sh)
    Variant("cifar-z0-fp16", "run_ds.sh defaults: ZeRO-0, fp16", TRAINING / "cifar", "cifar10_deepspeed.py",
            _cifar(0, "fp16"), _cifar_loss, _needs_cifar),
    Variant("cifar-z3-bf16", "run_ds.sh --stage 3 --dtype bf16", TRAINING / "cifar", "cifar10_deepspeed.py",
            _cifar(3, "bf16"), _cifar_loss, _needs_cifar),
    Variant("pipeline-parallelism", "pipeline_parallelism/run.sh: PipelineModule (AlexNet on CIFAR-10)",
            TRAINING / "pipeline_parallelism", "train.py",
            lambda inputs, run: ["--deepspeed_config=ds_config.json", "-p", "2", "--steps=4"], _no_loss,
            _needs_torchvision),
    Variant("hello-deepspeed", "HelloDeepSpeed/run_ds.sh: train_bert_ds.py", TRAINING / "HelloDeepSpeed",
            "train_bert_ds.py", lambda inputs, run: [], _no_loss,
            _needs_hub("the wikitext dataset (datasets.load_dataset('wikitext', ...))")),
]

_REFUSED = ("is not provided by zerodp", "not implemented", "zerodp does not", "not supported by zerodp")
"""Phrases of zerodp's refusals (a missing DeepSpeed API, a feature it lacks): the error names the feature."""


def first_error(log: str) -> str:
    """The exception line of the log's first traceback (rank prefixes removed), else its last line."""
    lines = [re.sub(r"^\[rank\d+\]:\s?|^\d+: ", "", line) for line in log.splitlines()]
    source = ""
    for index, line in enumerate(lines):
        if line.startswith("Traceback"):
            for after in lines[index + 1:]:
                if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", after):
                    # a bare `assert` says nothing: name the line that raised it
                    return after.strip() if ":" in after else f"{after.strip()} at `{source}`"
                if after.startswith("    ") and not after.lstrip().startswith(("File ", "^")):
                    source = after.strip()
    return lines[-1].strip() if lines else "(no output)"


def outcome(returncode: int, log: str) -> str:
    """"ran" / "refused: ..." / "failed: ..." for one launch."""
    if returncode == 0:
        return "ran"
    error = first_error(log)
    kind = "refused" if any(phrase in error for phrase in _REFUSED) else "failed"
    return f"{kind} ({returncode}): {error[:300]}"


def run_variant(variant: Variant, args, inputs: dict, work: Path, framework: str) -> tuple[str, float, str]:
    """Launch one variant on 2 processes under `framework`; (outcome, seconds, its log)."""
    run = work / f"{variant.name}-{framework}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    if variant.folder.parts[:2] == CHAT.parts:
        # DeepSpeed-Chat: bench/frameworks.py's copy (dschat/, training/, the local data, CHAT_PATCHES)
        chat = _chat_copy(Namespace(deepspeed_examples=args.examples), inputs, run)
        cwd, extra_path = chat / variant.folder.relative_to(CHAT), [str(chat)]
    else:
        cwd, extra_path = run / variant.folder.name, []
        shutil.copytree(args.examples / variant.folder, cwd)
        if variant.needs is _needs_cifar:  # the script reads ./data beside itself
            (cwd / "data").symlink_to(args.cifar_data, target_is_directory=True)
    env = environment(framework, run, inputs["shims"], args.python)
    # DeepSpeed-Chat's README installs its `dschat` package (`pip install -e .`); on the path is the same
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], *extra_path])
    shimmed = variant.cuda_shim and not args.cuda
    if shimmed:
        env["PYTHONPATH"] = os.pathsep.join([shim_path(run), env["PYTHONPATH"]])
    command = ["nice", "-n", "10", *chat_command(args.python, framework), variant.script,
               *variant.arguments(inputs, run)]
    log = run / "log.txt"
    start = time.monotonic()
    with log.open("w") as out:
        out.write(" ".join(command) + "\n")
        out.flush()
        launch = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            returncode = launch.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            # the whole session: the launcher's ranks would otherwise outlive it and hold --master_port
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
            returncode = -1
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    result = f"failed: timed out after {args.timeout:g} s" if returncode == -1 else outcome(returncode, text)
    if shimmed:
        result = "ran with the CUDA shim" if result == "ran" else f"{result} [with the CUDA shim]"
    return result, seconds, text


def compare(variant: Variant, logs: dict[str, str]) -> str | None:
    """max |zerodp - DeepSpeed| over the per-step losses both runs printed (None where there is nothing to compare)."""
    if variant.curve is None or len(logs) < 2:
        return None
    ours, theirs = variant.curve(logs["zerodp"]), variant.curve(logs["deepspeed"])
    common = sorted(set(ours) & set(theirs))
    if not common:
        return None
    diff, step = max((abs(ours[s] - theirs[s]), s) for s in common)
    equal = sum(ours[s] == theirs[s] for s in common)
    return f"max abs(zerodp - DeepSpeed) {diff:.2e} at loss {step} of {len(common)} ({equal} equal)"


def checkout_commit(examples: Path) -> str:
    found = subprocess.run(["git", "-C", str(examples), "rev-parse", "HEAD"], capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else "(not a git checkout)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=Path, required=True, help="a DeepSpeedExamples checkout (read only)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter of the runs: transformers, datasets (and deepspeed for --real-deepspeed)")
    parser.add_argument("--variants", default=",".join(v.name for v in VARIANTS), help="comma-separated (default: all)")
    parser.add_argument("--real-deepspeed", action="store_true", help="also run each with --python's real DeepSpeed")
    parser.add_argument("--cifar-data", type=Path, help="a folder holding CIFAR-10's cifar-10-batches-py")
    parser.add_argument("--work", type=Path, help="where runs write (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per launch (default 300)")
    args = parser.parse_args()
    args.examples = args.examples.resolve()
    args.cifar_data = args.cifar_data.resolve() if args.cifar_data else None
    args.cuda = _python_can(args.python, "import torch; assert torch.cuda.is_available()")
    by_name = {v.name: v for v in VARIANTS}
    unknown = [name for name in args.variants.split(",") if name not in by_name]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {', '.join(by_name)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="zerodp-ds-examples-"))
    inputs = make_inputs(work / "inputs", with_weights=True)
    frameworks = ["zerodp", "deepspeed"] if args.real_deepspeed else ["zerodp"]
    print(f"DeepSpeedExamples at {args.examples} (commit {checkout_commit(args.examples)}); python {args.python}; "
          f"work {work}")
    if not args.cuda and any(by_name[name].cuda_shim for name in args.variants.split(",")):
        print(f"{args.python} has no CUDA: the variants marked 'with the CUDA shim' run with torch.cuda.set_device "
              "and torch.cuda.reset_peak_memory_stats made no-ops (on both frameworks); the script's "
              "torch.autocast(device_type='cuda') is then disabled by torch, so the engine's torch_autocast applies")
    for name in args.variants.split(","):
        variant = by_name[name]
        missing = variant.needs(args)
        if not (args.examples / variant.folder / variant.script).exists():
            missing = f"{args.examples / variant.folder / variant.script} does not exist"
        logs = {}
        for framework in frameworks:
            if missing:
                print(f"| {name} | {framework} | {variant.settings} | not run: {missing} | | |", flush=True)
                continue
            result, seconds, logs[framework] = run_variant(variant, args, inputs, work, framework)
            loss = variant.loss(logs[framework])
            shown = "" if loss is None else f"{loss:.4f}"
            print(f"| {name} | {framework} | {variant.settings} | {result} | {seconds:.0f} s | {shown} |", flush=True)
        difference = compare(variant, logs)
        if difference:
            print(f"| {name} | both | {difference} | | | |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
