"""What every `zerodp` command shares: its exit codes, the parse of a whole-number flag, and the QLoRA
flags `estimate` and `plan` both take (with the model config's quantization_config they fall back on)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerodp.plan.quantized import QLoRA

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def positive_int(text: str) -> int:
    """argparse's `type` for a whole number >= 1 (ArgumentTypeError naming the text otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def qlora_from_flags(args: argparse.Namespace) -> QLoRA:
    """The QLoRA of `--lora-rank` (default 8), `--lora-targets` and `--double-quant`, as `zerodp estimate`
    and `zerodp plan` read them; ValueError naming the flag for a rank that is not a positive count."""
    from zerodp.plan.quantized import QLoRA
    from zerodp.sizes import parse_count

    rank = parse_count(args.lora_rank) if args.lora_rank is not None else 8
    if rank is None:
        raise ValueError(f"--lora-rank {args.lora_rank}: expected a positive adapter rank such as 8 or 64")
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()) or ("all-linear",)
    return QLoRA(rank, targets, args.double_quant)


def resolve_quantization(args: argparse.Namespace, module: Any, problems: list[str], command: str) -> None:
    """Set `args.quantization` (and `args.double_quant`) for `zerodp estimate` and `zerodp plan` (`command`):
    --quantization, else `module`'s Hugging Face quantization_config (with its double quantization). The flag
    wins; a config quantized otherwise than the flag says, or stored in another dtype than --dtype, is
    refused (appended to `problems`, naming the key, the value and the fix)."""
    from zerodp.plan.quantized import STORAGE_OF, config_quantization

    found = config_quantization(module)
    if args.quantization is None:
        args.quantization = found.quantization if found is not None else "none"
        if found is not None and found.quantization != "nf4":
            problems.append(f"MODEL {args.model}: its quantization_config is {found.quantization}; zerodp {command} "
                            f"counts nf4 (bitsandbytes 4-bit) only: give --quantization none to {command} the model "
                            "unquantized")
            args.quantization = "none"
    elif found is not None and args.quantization == "nf4" and found.quantization != "nf4":
        problems.append(f"--quantization nf4: MODEL {args.model}'s quantization_config is {found.quantization}, not "
                        f"nf4; drop the flag, or give --quantization none to {command} the model unquantized")
    if args.quantization != "nf4" or found is None:
        return
    args.double_quant = args.double_quant or found.double_quant
    if found.storage != STORAGE_OF[args.dtype]:
        problems.append(f"MODEL {args.model}: quantization_config bnb_4bit_quant_storage is {found.storage}, but "
                        f"--dtype {args.dtype} trains in {STORAGE_OF[args.dtype]}: zerodp refuses a 4-bit storage "
                        f"other than the training dtype (it would change the packed codes; uint8 works at stages 0-2 "
                        f"only); set bnb_4bit_quant_storage to {STORAGE_OF[args.dtype]}, or give --dtype to match")


def quantize_from_flags(args: argparse.Namespace, module: Any, problems: list[str], command: str) -> QLoRA | None:
    """The QLoRA `zerodp estimate` / `zerodp plan` (`command`) count for `module` (on the meta device), from the
    flags and the model's quantization_config (`resolve_quantization`), applied to `module`; None when the model
    trains unquantized or a flag is wrong (appended to `problems`)."""
    from zerodp.plan.model_states import DTYPES
    from zerodp.plan.quantized import apply_qlora

    resolve_quantization(args, module, problems, command)
    if args.quantization == "none":
        return None
    try:
        qlora = qlora_from_flags(args)
        apply_qlora(module, qlora, DTYPES[args.dtype])
    except ValueError as err:
        problems.append(str(err))
        return None
    return qlora


def add_zeropp_flags(parser: argparse.ArgumentParser, hpz: bool) -> None:
    """The ZeRO++ flags of `zerodp estimate` (and of `zerodp plan`, without hpZ: its step-time model does not
    price bytes by link, and hpZ's point is which link they take)."""
    for what, text in (("weights", "qwZ at stage 3: the forward and backward all-gathers send int8 blocks of 256 "
                                   "with one fp32 scale each"),
                       ("gradients", "qgZ at stage 3: the gradient reduce-scatter becomes an all-to-all of int8 "
                                     "blocks and scales")):
        parser.add_argument(f"--zero-quantized-{what}", action="store_true", help=f"ZeRO++ {text} (zero_quantized_{what})")
    if hpz:
        parser.add_argument("--zero-hpz-partition-size", default="1", metavar="S",
                            help="ZeRO++ hpZ at stage 3: a secondary copy of the parameters over S ranks (the ranks per "
                                 "node; zero_hpz_partition_size; default 1: none); bytes by link count nodes of S ranks")


def zeropp_from_flags(args: argparse.Namespace, world: int | None, sp: int, problems: list[str]) -> Any:
    """The ZeroPlusPlus of the flags (zerodp/plan/zeropp.py), checked as the runtime checks the keys."""
    from zerodp.plan.zeropp import ZeroPlusPlus
    from zerodp.sizes import parse_count

    text = getattr(args, "zero_hpz_partition_size", "1")
    size = parse_count(text)
    if size is None:
        problems.append(f"--zero-hpz-partition-size {text}: expected a positive number of ranks")
        size = 1
    zeropp = ZeroPlusPlus(args.zero_quantized_weights, args.zero_quantized_gradients, size)
    problems.extend(zeropp.problems(world))
    if zeropp and sp > 1:
        flags = "--zero-quantized-weights/--zero-quantized-gradients" + ("/--zero-hpz-partition-size" if size > 1 else "")
        problems.append(f"{flags} with --sequence-parallel {sp}: the runtime does not build ZeRO++ with sequence "
                        "parallelism; drop one")
    return zeropp
