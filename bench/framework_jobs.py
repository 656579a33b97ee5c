"""The jobs of bench/frameworks.py: how each framework's own script is launched, and what is compared.

Each job's `run(args, inputs, out, environment, run)` launches the unchanged script on 2 processes under
zerodp and under DeepSpeed and returns ({curve name: {step: loss}}, [check lines]); a check that fails
raises, so the bench exits non-zero.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tests.framework_inputs import run_clm_args, trl_sft_args

RESUME_BAND = 5e-4
"""zerodp resumed from DeepSpeed's checkpoint against DeepSpeed's uninterrupted run: bf16 forward and
backward on two implementations (run_clm measured 5.1e-5 over 6 steps)."""


@dataclass
class Job:
    name: str
    needs: Callable[[object], str | None]
    body: Callable
    band: float = 5e-4
    """The largest |zerodp - DeepSpeed| allowed: bf16 forward and backward in two implementations
    (measured 5.1e-5 to 2.6e-4 on the losses, docs/deepspeed.md)."""

    def missing(self, args) -> str | None:
        return self.needs(args)

    def run(self, args, inputs: dict, out: Path, environment, run) -> tuple[dict, list[str]]:
        out.mkdir(parents=True, exist_ok=True)
        return self.body(args, inputs, out, environment, run)


def torchrun(python: str) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _run_clm_script(args) -> Path:
    return args.transformers_src / "examples" / "pytorch" / "language-modeling" / "run_clm.py"


def _needs_clm(args) -> str | None:
    if args.transformers_src is None:
        return "--transformers-src (a transformers checkout, for examples/pytorch/language-modeling/run_clm.py)"
    if not _run_clm_script(args).exists():
        return f"{_run_clm_script(args)} does not exist"
    return None


def _same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)


def clm(args, inputs: dict, out: Path, environment, run) -> tuple[dict, list[str]]:
    """run_clm.py: 6 steps saving at 3 on each; zerodp resumed from its own and from DeepSpeed's checkpoint-3."""
    from bench.frameworks import state_losses

    python = args.deepspeed_python

    def launch(framework: str, name: str, resume: Path | None = None) -> dict[int, float]:
        command = [*torchrun(python), str(_run_clm_script(args)), *run_clm_args(inputs, out / name)]
        if resume is not None:
            command += ["--resume_from_checkpoint", str(resume)]
        run(command, environment(framework, out, inputs["shims"], python), out / f"{name}.log", args.timeout)
        return state_losses(out / name)

    results = {"zerodp": launch("zerodp", "zerodp"), "deepspeed": launch("deepspeed", "deepspeed")}
    own = launch("zerodp", "zerodp-resumed", out / "zerodp" / "checkpoint-3")
    after = [s for s in results["zerodp"] if s > 3]
    bitwise = all(own[s] == results["zerodp"][s] for s in after) and _same_weights(out / "zerodp",
                                                                                  out / "zerodp-resumed")
    theirs = launch("zerodp", "zerodp-from-deepspeed", out / "deepspeed" / "checkpoint-3")
    results["zerodp resumed at 3"] = {s: own[s] for s in after}
    results["zerodp from DeepSpeed's 3"] = {s: theirs[s] for s in after}
    worst = max(abs(theirs[s] - results["deepspeed"][s]) for s in after)
    checks = [f"zerodp resumed from its checkpoint-3 equals its uninterrupted run bitwise "
              f"(losses {after[0]}-{after[-1]} and saved weights): {bitwise}",
              f"zerodp resumed from DeepSpeed's checkpoint-3 against DeepSpeed uninterrupted, steps "
              f"{after[0]}-{after[-1]}: max |diff| {worst:.3e} (band {RESUME_BAND:g})"]
    if not bitwise or worst > RESUME_BAND:
        raise RuntimeError("; ".join(checks))
    return results, checks


def _trl_sft_script(python: str) -> Path | None:
    """trl/scripts/sft.py of the trl that `python` imports (None without trl)."""
    found = subprocess.run([python, "-c", "import os, trl; print(os.path.dirname(trl.__file__))"],
                           capture_output=True, text=True)
    return Path(found.stdout.strip()) / "scripts" / "sft.py" if found.returncode == 0 else None


def _needs_trl(args) -> str | None:
    return None if _trl_sft_script(args.deepspeed_python) else f"trl is not installed in {args.deepspeed_python}"


def accelerate_launch(python: str, config: Path) -> list[str]:
    """`accelerate launch --config_file CONFIG --num_processes 2` with `python`'s accelerate."""
    return [python, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2"]


def trl_sft(args, inputs: dict, out: Path, environment, run) -> tuple[dict, list[str]]:
    """TRL's sft.py under accelerate launch with TRL's own ZeRO-3 accelerate config (bf16, zero3_init)."""
    from bench.frameworks import state_losses

    script = _trl_sft_script(args.deepspeed_python)
    config = script.parent.parent / "accelerate_configs" / "zero3.yaml"
    results = {}
    for framework in ("zerodp", "deepspeed"):
        command = [*accelerate_launch(args.deepspeed_python, config), str(script),
                   *trl_sft_args(inputs, out / framework)]
        env = environment(framework, out, inputs["shims"], args.deepspeed_python)
        run(command, env, out / f"{framework}.log", args.timeout)
        results[framework] = state_losses(out / framework)
    engine = [p.name for p in (out / "zerodp" / "checkpoint-6").iterdir() if p.name.startswith("global_step")]
    return results, [f"zerodp's checkpoint holds a ZeRO engine's state: {engine}"]


CHAT = Path("applications") / "DeepSpeed-Chat"
CHAT_STEPS = {"dschat_sft": "step1_supervised_finetuning", "dschat_rm": "step2_reward_model_finetuning"}


CHAT_PATCHES = [  # (file, text, replacement), applied to the copy: what DeepSpeed-Chat needs on transformers 5
    # transformers 5 moved `no_init_weights` from modeling_utils to transformers.initialization
    ("dschat/utils/model/model_utils.py", "from transformers.modeling_utils import no_init_weights",
     "from transformers.initialization import no_init_weights"),
    # transformers 5's tokenizers loaded from tokenizer.json have no `vocab_file`, which
    # `save_vocabulary` reads (AttributeError at the final save); save_pretrained writes the same files
    ("dschat/utils/utils.py", "tokenizer.save_vocabulary(output_dir)", "tokenizer.save_pretrained(output_dir)"),
]


def _needs_chat(args) -> str | None:
    if args.deepspeed_examples is None:
        return "--deepspeed-examples (a DeepSpeedExamples checkout, for applications/DeepSpeed-Chat)"
    missing = [step for step in CHAT_STEPS.values()
               if not (args.deepspeed_examples / CHAT / "training" / step / "main.py").exists()]
    return f"{args.deepspeed_examples / CHAT}/training lacks {missing}" if missing else None


def _chat_copy(args, inputs: dict, out: Path) -> Path:
    """A copy of the checkout's DeepSpeed-Chat (dschat/ and training/) with the local data where the script's
    `--data_path local/jsonfile` reads it (DeepSpeed-Chat/data/train.json and eval.json): the checkout
    itself is not written to."""
    chat = out / "DeepSpeed-Chat"
    if not chat.exists():
        source = args.deepspeed_examples / CHAT
        for part in ("dschat", "training"):
            shutil.copytree(source / part, chat / part, ignore=shutil.ignore_patterns("*.log", "assets"))
        for relative, before, after in CHAT_PATCHES:
            path = chat / relative
            path.write_text(path.read_text().replace(before, after))
        (chat / "data").mkdir()
        rows = inputs["pairs_jsonl"].read_text().splitlines()
        (chat / "data" / "train.json").write_text("\n".join(rows[:64]) + "\n")
        (chat / "data" / "eval.json").write_text("\n".join(rows[64:80]) + "\n")
    return chat


def chat_command(python: str, framework: str) -> list[str]:
    """The DeepSpeed launcher (it passes --local_rank, which DeepSpeed-Chat's main.py requires): zerodp's
    `zerodp deepspeed` and DeepSpeed's `deepspeed`, both with --num_gpus 2."""
    if framework == "zerodp":
        launcher = [python, "-c", "from zerodp.cli import main; raise SystemExit(main())", "deepspeed"]
    else:
        launcher = [python, "-c", "from deepspeed.launcher.runner import main; raise SystemExit(main())"]
    return [*launcher, "--num_gpus", "2", "--master_port", "29613"]


def chat_args(step: str, inputs: dict, output: Path, data_cache: Path) -> list[str]:
    """One whole epoch of 64 rows (16 optimizer steps at 2 ranks x micro-batch 2), ZeRO-3, bf16, the final
    save; step 1 with the loss in fp32 (so the printed loss is not rounded to bf16). Step 2 at ZeRO-2:
    at ZeRO-3 in bf16 it fails on DeepSpeed 0.19.8 itself (the reward head, an nn.Linear the script
    builds after `from_pretrained` under zero.Init, stays fp32 beside bf16 partitions, and DeepSpeed's
    stage-3 optimizer asserts one dtype per group in `defragment`); zerodp runs it at ZeRO-3."""
    split = "10,0,0" if step == "dschat_sft" else "0,10,0"
    common = ["--data_path", "local/jsonfile", "--data_split", split, "--data_output_path", str(data_cache),
              "--model_name_or_path", str(inputs["model"]), "--per_device_train_batch_size", "2",
              "--per_device_eval_batch_size", "2", "--max_seq_len", "32", "--learning_rate", "1e-3",
              "--num_train_epochs", "1", "--gradient_accumulation_steps", "1", "--lr_scheduler_type", "cosine",
              "--num_warmup_steps", "0", "--seed", "1234", "--zero_stage", "3" if step == "dschat_sft" else "2",
              "--dtype", "bf16", "--output_dir", str(output)]
    if step == "dschat_sft":
        return [*common, "--print_loss", "--compute_fp32_loss"]
    return [*common, "--num_padding_at_beginning", "0", "--eval_interval", "1", "--eval_iters", "4"]


_SFT_LOSS = re.compile(r"Epoch: 0, Step: (\d+), Rank: (\d+), loss = ([-0-9.e]+)")
_RM_ITER = re.compile(r"Iter (\d+): c_scores: ([-0-9.e]+), r_scores: ([-0-9.e]+)")


def chat_curves(step: str, log: str) -> dict[int, float]:
    """Step 1: each micro-step's loss (rank 0 and rank 1 as steps 2i and 2i+1); step 2: the chosen-minus-
    rejected eval score after each optimizer step (the script prints no per-step loss) and, at step 0,
    the epoch's mean loss."""
    if step == "dschat_sft":
        found = {(int(s), int(r)): float(v) for s, r, v in _SFT_LOSS.findall(log)}
        return {2 * s + r: v for (s, r), v in found.items()}
    curve = {int(i): float(c) - float(r) for i, c, r in _RM_ITER.findall(log)}
    mean = re.search(r"Epoch 1/1 with loss ([-0-9.e]+)", log)
    if mean:
        curve[0] = float(mean.group(1))
    return curve


def _chat_job(step: str):
    def body(args, inputs: dict, out: Path, environment, run) -> tuple[dict, list[str]]:
        chat = _chat_copy(args, inputs, out)
        results, checks = {}, []
        for framework in ("zerodp", "deepspeed"):
            output = out / framework
            command = [*chat_command(args.deepspeed_python, framework), "main.py",
                       *chat_args(step, inputs, output, out / f"data-{framework}")]
            env = environment(framework, out, inputs["shims"], args.deepspeed_python)
            # DeepSpeed-Chat's README installs its `dschat` package (`pip install -e .` in DeepSpeed-Chat/)
            env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(chat)])
            log = out / f"{framework}.log"
            run(command, env, log, args.timeout, cwd=chat / "training" / CHAT_STEPS[step])
            results[framework] = chat_curves(step, log.read_text())
            saved = sorted(p.name for p in output.iterdir())
            checks.append(f"{framework} saved {saved}")
            if not results[framework]:
                raise RuntimeError(f"no losses in {log}")
        return results, checks
    return body


def _needs_llamafactory(args) -> str | None:
    if args.llamafactory_python is None:
        return ("--llamafactory-python (an interpreter where `pip install llamafactory` succeeded; it pins its own "
                "transformers, trl, accelerate and torch, so use a separate venv with deepspeed==0.19.8 added)")
    if args.llamafactory_src is None or not (args.llamafactory_src / LF_DS_CONFIG).exists():
        return f"--llamafactory-src (a LLaMA-Factory checkout holding {LF_DS_CONFIG})"
    return None


LF_DS_CONFIG = Path("examples") / "deepspeed" / "ds_z3_config.json"


def llamafactory_config(args, inputs: dict, out: Path, framework: str) -> Path:
    """`llamafactory-cli train` YAML: full SFT of the tiny Llama on local alpaca-format rows, its ZeRO-3 config."""
    data = out / "data"
    if not data.exists():
        data.mkdir(parents=True)
        rows = [json.loads(line) for line in inputs["pairs_jsonl"].read_text().splitlines()[:64]]
        (data / "tiny_sft.json").write_text(json.dumps(
            [{"instruction": r["prompt"], "input": "", "output": r["chosen"]} for r in rows]))
        (data / "dataset_info.json").write_text(json.dumps({"tiny_sft": {"file_name": "tiny_sft.json"}}))
    settings = {"model_name_or_path": inputs["model"], "stage": "sft", "do_train": True, "finetuning_type": "full",
                "deepspeed": args.llamafactory_src / LF_DS_CONFIG, "dataset": "tiny_sft", "dataset_dir": data,
                "template": "default", "cutoff_len": 32, "overwrite_cache": True, "output_dir": out / framework,
                "logging_steps": 1, "save_steps": 1000, "plot_loss": False, "overwrite_output_dir": True,
                "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 1e-3,
                "max_steps": 6, "lr_scheduler_type": "cosine", "warmup_ratio": 0.0, "bf16": True, "use_cpu": True,
                "report_to": "none", "seed": 0, "dataloader_num_workers": 0, "disable_tqdm": True}
    path = out / f"{framework}.yaml"
    path.write_text("".join(f"{key}: {json.dumps(str(v) if isinstance(v, Path) else v)}\n"
                            for key, v in settings.items()))
    return path


def llamafactory(args, inputs: dict, out: Path, environment, run) -> tuple[dict, list[str]]:
    """`llamafactory-cli train` on 2 processes (FORCE_TORCHRUN) with LLaMA-Factory's own ds_z3_config.json."""
    from bench.frameworks import state_losses

    python = args.llamafactory_python
    results = {}
    for framework in ("zerodp", "deepspeed"):
        env = {**environment(framework, out, inputs["shims"], python), "FORCE_TORCHRUN": "1", "NNODES": "1",
               "NPROC_PER_NODE": "2", "MASTER_PORT": "29617", "DISABLE_VERSION_CHECK": "1"}
        # llamafactory-cli starts `torchrun` from PATH: the one of its own venv
        env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "")])
        command = [python, "-c", "from llamafactory.cli import main; main()", "train",
                   str(llamafactory_config(args, inputs, out, framework))]
        run(command, env, out / f"{framework}.log", args.timeout)
        results[framework] = state_losses(out / framework)
    return results, []


JOBS = {"clm": Job("clm", _needs_clm, clm), "trl_sft": Job("trl_sft", _needs_trl, trl_sft),
        "llamafactory": Job("llamafactory", _needs_llamafactory, llamafactory),
        "dschat_sft": Job("dschat_sft", _needs_chat, _chat_job("dschat_sft")),
        # step 2 prints bf16 scores (means near 1.2) and a bf16 loss: one bf16 ulp there is 2**-7
        "dschat_rm": Job("dschat_rm", _needs_chat, _chat_job("dschat_rm"), band=2 ** -7)}

if __name__ == "__main__":
    sys.exit("run bench/frameworks.py")
