"""Local inputs for third-party training scripts run unchanged (tests/test_frameworks.py, bench/frameworks.py).

Nothing here reaches a model hub: a tiny Llama config directory, a byte-pair tokenizer trained on the local
text and saved as a Hugging Face tokenizer directory, the text itself (train.txt, and the same lines as
`{"text": ...}` JSON lines and as prompt/chosen/rejected rows for the scripts that want those), and the
DeepSpeed ZeRO-3 "auto" config that the Hugging Face documentation gives. Everything is derived from fixed
seeds, so two runs (zerodp and DeepSpeed) read byte-identical inputs.

The scripts themselves are not in this repository: they belong to their projects. A run takes them from a
checkout the user names (`--transformers-src`, `--deepspeed-examples`) or, for TRL, from the installed
package, and `script_path` finds them.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

WORDS = ("the cat dog sat ran on a mat log red blue small big quick slow fox jumps over lazy day night sun moon "
         "tree river stone bird sings under above near far old new").split()

DS_ZERO3_AUTO = {  # the ZeRO-3 config of transformers' DeepSpeed guide, "auto" wherever it has "auto"
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"},
                          "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def sentences(count: int, seed: int = 0) -> list[str]:
    """`count` short lines of words from WORDS, the same for a given seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(count)]


def write_tokenizer(lines: list[str], out: Path, vocab_size: int = 96, max_length: int = 64) -> int:
    """Train a byte-level BPE tokenizer on `lines` and save it as a Hugging Face tokenizer directory.

    Returns the vocabulary size, which the model config must match (run_clm.py resizes the embeddings
    otherwise)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>", model_max_length=max_length)
    # a chat template for the scripts that format conversations (TRL's SFT on "messages")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(out)
    return len(fast)


def write_model_dir(out: Path, vocab_size: int, with_weights: bool, max_length: int = 64) -> None:
    """A tiny Llama's config.json in `out` (and, with `with_weights`, its seeded weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_length,
                         bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    if not with_weights:
        config.save_pretrained(out)
        return
    import torch

    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)


def make_inputs(root: Path, with_weights: bool = False) -> dict[str, Path]:
    """Write every input under `root` once; returns the paths by name (idempotent)."""
    root.mkdir(parents=True, exist_ok=True)
    paths = {"model": root / "model", "train_txt": root / "train.txt", "train_jsonl": root / "train.jsonl",
             "pairs_jsonl": root / "pairs.jsonl", "sft_dir": root / "sft", "ds_zero3": root / "ds_zero3_auto.json",
             "shims": root / "shims"}
    lines = sentences(400)
    if not paths["train_txt"].exists():
        paths["train_txt"].write_text("\n".join(lines) + "\n")
        paths["train_jsonl"].write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
        paths["pairs_jsonl"].write_text("".join(
            json.dumps({"prompt": " ".join(line.split()[:4]), "chosen": " ".join(line.split()[4:]),
                        "rejected": " ".join(reversed(line.split()[4:]))}) + "\n" for line in lines))
        paths["ds_zero3"].write_text(json.dumps(DS_ZERO3_AUTO, indent=2))
        paths["sft_dir"].mkdir(exist_ok=True)  # a folder holding train.jsonl: `load_dataset(folder)` reads it
        (paths["sft_dir"] / "train.jsonl").write_text(paths["train_jsonl"].read_text())
    if not (paths["model"] / "config.json").exists() or (with_weights and not _has_weights(paths["model"])):
        vocab = write_tokenizer(lines, paths["model"])
        write_model_dir(paths["model"], vocab, with_weights)
    _write_evaluate_shim(paths["shims"])
    return paths


def _has_weights(model_dir: Path) -> bool:
    return any(model_dir.glob("*.safetensors"))


def _write_evaluate_shim(shims: Path) -> None:
    """A stand-in `evaluate` package for where the real one is not installed.

    run_clm.py imports `evaluate` at the top and uses it only under --do_eval (accuracy); the runs here do
    not evaluate, so the stand-in refuses to be used rather than computing anything."""
    package = shims / "evaluate"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        '"""Stand-in: the real `evaluate` is not installed; these runs never call it."""\n\n\n'
        "def load(*args, **kwargs):\n"
        "    raise RuntimeError('evaluate is not installed: pip install evaluate (needed for --do_eval)')\n")


def python_path(repo: Path, shims: Path) -> str:
    """PYTHONPATH for a run: the repository (zerodp) and, if `evaluate` is missing, its stand-in."""
    import importlib.util

    parts = [str(repo)]
    if importlib.util.find_spec("evaluate") is None:
        parts.append(str(shims))
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)


def run_clm_args(inputs: dict[str, Path], output_dir: Path, max_steps: int = 6, save_steps: int = 3) -> list[str]:
    """run_clm.py's arguments: a from-scratch tiny Llama, local text, ZeRO-3 "auto", bf16, 2-step accumulation."""
    model = str(inputs["model"])
    return ["--config_name", model, "--tokenizer_name", model, "--train_file", str(inputs["train_txt"]),
            "--block_size", "32", "--do_train", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--max_steps", str(max_steps), "--logging_steps", "1",
            "--save_steps", str(save_steps), "--learning_rate", "1e-3", "--warmup_steps", "2", "--bf16",
            "--use_cpu", "--deepspeed", str(inputs["ds_zero3"]), "--output_dir", str(output_dir),
            "--report_to", "none", "--seed", "0", "--dataloader_num_workers", "0", "--disable_tqdm", "true"]


def trl_sft_args(inputs: dict[str, Path], output_dir: Path, max_steps: int = 6) -> list[str]:
    """TRL sft.py's arguments: the tiny Llama with weights, local {"text"} rows, bf16, a save at the end."""
    return ["--model_name_or_path", str(inputs["model"]), "--dataset_name", str(inputs["sft_dir"]),
            "--max_length", "32", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--max_steps", str(max_steps), "--logging_steps", "1", "--learning_rate", "1e-3",
            "--output_dir", str(output_dir), "--report_to", "none", "--seed", "0", "--save_strategy", "steps",
            "--save_steps", str(max_steps), "--disable_tqdm", "true", "--use_cpu", "true"]
