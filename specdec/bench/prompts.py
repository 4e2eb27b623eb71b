"""Prompts of the benchmarks: MT-Bench style jsonl files (one question a line, first of ``turns`` used).

The 80 MT-Bench questions ship with the package (``data/mt_bench_questions.jsonl``, from lm-sys/FastChat,
Apache License 2.0; see ``data/NOTICE``); ``--prompts FILE`` replaces them.
"""
from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

PROMPTS_FILE = "mt_bench_questions.jsonl"


def default_prompts_path() -> Path:
    """The MT-Bench questions shipped inside the package (``specdec/bench/data/``)."""
    try:
        path = Path(str(resources.files(__package__).joinpath("data", PROMPTS_FILE)))
    except (TypeError, ModuleNotFoundError):  # not importable as a package: fall back to this file's folder
        path = Path(__file__).resolve().parent / "data" / PROMPTS_FILE
    return path


def load_prompts(path: str | Path, n: int) -> list[str]:
    """First turns of the first ``n`` questions of an MT-Bench style jsonl."""
    return [text for _, text in load_questions(path, n)]


def load_questions(path: str | Path, n: int) -> list[tuple[object, str]]:
    """``(question_id, first turn)`` of the first ``n`` questions of an MT-Bench style jsonl."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist (pass --prompts)")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                turns = rec.get("turns")
                if not turns:
                    raise ValueError(f"{path}: a line has no 'turns': {line[:80]!r}")
                prompts.append((rec.get("question_id", len(prompts)), turns[0]))
    if n < 1 or n > len(prompts):
        raise ValueError(f"--num-prompts={n}: {path} holds {len(prompts)} prompts")
    return prompts[:n]


def int_list(text: str) -> list[int]:
    """argparse type: ``"2,4,6"`` -> ``[2, 4, 6]``."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_prompt_arguments(parser: argparse.ArgumentParser, num_prompts: int = 10) -> None:
    """``--prompts`` and ``--num-prompts``, shared by both benchmarks."""
    parser.add_argument("--prompts", default=None,
                        help="MT-Bench style jsonl, first of 'turns' used (default: the MT-Bench questions "
                             f"shipped with specdec, {PROMPTS_FILE})")
    parser.add_argument("--num-prompts", type=int, default=num_prompts,
                        help=f"first N questions (default {num_prompts})")
