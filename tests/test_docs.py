"""The README and docs/ stay true to the code.

- Every code block marked `<!-- runnable -->` (on the line before its fence) runs and succeeds:
  README.md first, then docs/*.md by name, each block in order, all in one directory, so a block may
  use what an earlier one made (the quick start saves ./ckpt; the checkpoint docs convert it). The
  directory starts with the two files the README's launch line names: `ds_config.json` and a
  DeepSpeed-style `train.py`. Python blocks run as scripts with this interpreter; bash blocks with
  `bash -e`, the `zerodp` command on PATH.
- Every `zerodp COMMAND` the docs mention exists, and every repository file they name exists.
- Every key zerodp/config/keys.py lists appears in docs/config.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_TRAIN_PY = textwrap.dedent("""
    import argparse, zerodp
    from zerodp.demo import DEMO_DEFAULT, SyntheticTaskDataset, TinyGPT

    parser = zerodp.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()
    data = SyntheticTaskDataset(64, DEMO_DEFAULT.seq_len, DEMO_DEFAULT.vocab_size)
    engine, _, loader, _ = zerodp.initialize(args=args, model=TinyGPT(DEMO_DEFAULT), training_data=data)
    for idx, targets in loader:
        engine.backward(engine(idx, targets))
        engine.step()
""")
_DS_CONFIG = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}


def code_blocks(path: Path) -> list[tuple[int, str, str, bool]]:
    """(first line number, language, code, marked runnable) of every fenced block in `path`."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            runnable = i > 0 and lines[i - 1].startswith("<!-- runnable")
            blocks.append((i + 2, lines[i][3:].strip(), "\n".join(lines[i + 1 : end]) + "\n", runnable))
            i = end
        i += 1
    return blocks


def test_the_runnable_blocks_run(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(_TRAIN_PY)
    (tmp_path / "ds_config.json").write_text(json.dumps(_DS_CONFIG))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)  # the installed package, as a user has it
    ran = []
    for doc in DOCS:
        for line, language, code, runnable in code_blocks(doc):
            if not runnable:
                continue
            where = f"{doc.relative_to(ROOT)}:{line}"
            if language == "python":
                script = tmp_path / "block.py"
                script.write_text(code)
                argv = [sys.executable, str(script)]
            elif language == "bash":
                argv = ["bash", "-e", "-c", code]
            else:
                raise AssertionError(f"{where}: a runnable block must be python or bash, not {language!r}")
            result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, f"{where} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
            ran.append(where)
    assert len(ran) >= 5, ran


def _subcommands() -> set[str]:
    from zerodp.cli import _parser

    parser = _parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return set(action.choices)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_docs_name_only_commands_and_files_that_exist(doc: Path) -> None:
    text = doc.read_text()
    shell = "".join(code for _, language, code, _ in code_blocks(doc) if language in ("bash", ""))
    commands = set(re.findall(r"`zerodp ([a-z]+)[ `]", text)) | set(re.findall(r"^zerodp ([a-z]+)", shell, re.M))
    assert commands <= _subcommands(), f"{doc.name} names zerodp commands that do not exist: {commands - _subcommands()}"
    for name in re.findall(r"\b((?:docs|tests|bench|zerodp)/[\w/]+\.(?:md|py)|design\.md)\b", text):
        assert (ROOT / name).exists(), f"{doc.name} names {name}, which is not in the repository"


def test_config_md_lists_every_key_zerodp_does_not_read() -> None:
    from zerodp.config.keys import NO_EFFECT, NOT_IMPLEMENTED, NOT_IMPLEMENTED_AT_STAGE_3, SWITCHED_SECTIONS

    text = (ROOT / "docs" / "config.md").read_text()
    keys = [*NOT_IMPLEMENTED, *NOT_IMPLEMENTED_AT_STAGE_3, *NO_EFFECT,
            *(f"{section}.{switch}" for section, (switch, _) in SWITCHED_SECTIONS.items())]
    missing = [key for key in keys if key.rpartition(".")[2] not in text]
    assert missing == [], f"docs/config.md does not mention {missing}"


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    anchors, fenced = set(), False
    for line in doc.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            anchors.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_docs_links_reach_a_file_and_a_heading(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert broken == [], f"{doc.name} links to missing files or headings: {broken}"


# Commands docs/guide.md shows that no runnable block runs: where they run instead, or why they do not.
_GUIDE_RUN_ELSEWHERE = {
    "zerodp run --nproc-per-node 2 tests/scripts/hf_trainer.py 3 out/": "tests/test_hf_integration.py runs this script",
    "ZERODP_AS_DEEPSPEED=1 accelerate launch --use_deepspeed --zero_stage 3 --num_processes 2 --mixed_precision bf16 "
    "--zero3_save_16bit_model true tests/scripts/accelerate_loop.py out/": "tests/test_hf_integration.py runs this script",
    "zerodp plan docs/models/llama-70b --gpu a100-80gb --gpus-per-node 8 --seq-len 2048 --global-batch 64 --nvme 4TB "
    "--output ds_plan.json": "minutes of simulation; tests/test_plan.py plans smaller models with the same flags",
}


def _shell_commands(code: str) -> list[str]:
    """The command lines of a shell block, continuations joined, comments and spacing dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [" ".join(line.split("#")[0].split()) for line in joined.splitlines() if line.split("#")[0].strip()]


def test_every_command_the_guide_shows_runs_in_ci() -> None:
    ran = {cmd for doc in DOCS for _, language, code, runnable in code_blocks(doc)
           if runnable and language in ("bash", "") for cmd in _shell_commands(code)}
    shown = [cmd for _, language, code, _ in code_blocks(ROOT / "docs" / "guide.md") if language in ("bash", "")
             for cmd in _shell_commands(code)]
    assert set(_GUIDE_RUN_ELSEWHERE) <= set(shown), "an entry of _GUIDE_RUN_ELSEWHERE is no longer in the guide"
    missing = [cmd for cmd in shown if cmd not in ran and cmd not in _GUIDE_RUN_ELSEWHERE]
    assert missing == [], f"docs/guide.md shows commands no runnable block runs: {missing}"


def test_the_chinese_guide_is_the_english_one_section_for_section() -> None:
    """docs/guide.zh.md translates the prose only: the same numbered sections in the same order, and
    the same code blocks byte for byte (so its commands and configs are the ones CI runs in guide.md),
    none of them run a second time."""
    english, chinese = ROOT / "docs" / "guide.md", ROOT / "docs" / "guide.zh.md"
    sections = [re.findall(r"^(#+) (\d+[a-z]?)\. ", doc.read_text(), flags=re.M) for doc in (english, chinese)]
    assert sections[0] == sections[1] and len(sections[0]) >= 23, sections
    blocks = [[(language, code) for _, language, code, _ in code_blocks(doc)] for doc in (english, chinese)]
    assert blocks[0] == blocks[1], "docs/guide.zh.md's code blocks are not guide.md's: copy them over unchanged"
    assert not any(runnable for *_, runnable in code_blocks(chinese))
