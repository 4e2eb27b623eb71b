"""Prompts of the benchmarks: MT-Bench style jsonl files (one question a line, first of ``turns`` used).

Two prompt sets ship with the package (``data/``, see ``data/NOTICE``):

- ``mt-bench`` (the default): the 80 MT-Bench questions (``mt_bench_questions.jsonl``, from lm-sys/FastChat,
  Apache License 2.0);
- ``varied``: 50 prompts written for this project (``varied_prompts.jsonl``), 10 per category: translation,
  summarization, qa, math, rag (several retrieved documents of 500-1,200 words, then a question to answer by
  quoting them). Never used for training (the shipped drafts were trained on prompts the target synthesised).
  Every prompt fits the embedded model's chat template in < 1,000 tokens;
- ``code``: 16 coding requests written for this project (``code_prompts.jsonl``): function completions,
  bug fixes and refactors in Python, JavaScript, C, Go and SQL — the workload of the Qwen2.5-Coder pair.

``--prompts`` takes one of these names or the path of an MT-Bench style jsonl (``resolve_prompts``).
"""
from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

PROMPTS_FILE = "mt_bench_questions.jsonl"
VARIED_PROMPTS_FILE = "varied_prompts.jsonl"
CODE_PROMPTS_FILE = "code_prompts.jsonl"
PROMPT_SETS = {"mt-bench": PROMPTS_FILE, "varied": VARIED_PROMPTS_FILE, "code": CODE_PROMPTS_FILE}


def _data_path(name: str) -> Path:
    try:
        path = Path(str(resources.files(__package__).joinpath("data", name)))
    except (TypeError, ModuleNotFoundError):  # not importable as a package: fall back to this file's folder
        path = Path(__file__).resolve().parent / "data" / name
    return path


def default_prompts_path() -> Path:
    """The MT-Bench questions shipped inside the package (``specdec/tools/bench/data/``)."""
    return _data_path(PROMPTS_FILE)


def varied_prompts_path() -> Path:
    """The varied prompt set shipped inside the package (translation, summarization, qa, math, rag)."""
    return _data_path(VARIED_PROMPTS_FILE)


def resolve_prompts(spec: str | Path | None) -> Path:
    """``--prompts`` value → a jsonl path: None or ``"mt-bench"`` = MT-Bench, ``"varied"`` = the varied set
    (names win only when no file of that name exists), else the path itself."""
    if spec is None:
        return default_prompts_path()
    key = str(spec).lower().replace("_", "-")
    if key in PROMPT_SETS and not Path(spec).exists():
        return _data_path(PROMPT_SETS[key])
    return Path(spec)


def load_prompts(path: str | Path, n: int) -> list[str]:
    """First turns of the first ``n`` questions of an MT-Bench style jsonl."""
    return [text for _, text in load_questions(path, n)]


def load_questions(path: str | Path, n: int) -> list[tuple[object, str]]:
    """``(question_id, first turn)`` of the first ``n`` questions of an MT-Bench style jsonl (or a set name,
    ``resolve_prompts``)."""
    return [(q, text) for q, _, text in load_records(path, n)]


def load_records(path: str | Path | None, n: int | None = None, categories: str | list[str] | None = None,
                 per_category: int | None = None) -> list[tuple[object, str, str]]:
    """``(question_id, category, first turn)`` of an MT-Bench style jsonl (a path or a set name; None =
    MT-Bench); ``categories`` keeps only those (a name or a list), ``per_category`` the first N of each
    category (in file order), then the first ``n`` (None = all). Lines without a category get ``"none"``."""
    path = resolve_prompts(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist (pass --prompts)")
    wanted = [categories] if isinstance(categories, str) else categories
    records = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                turns = rec.get("turns")
                if not turns:
                    raise ValueError(f"{path}: a line has no 'turns': {line[:80]!r}")
                cat = rec.get("category", "none")
                if wanted is None or cat in wanted:
                    records.append((rec.get("question_id", len(records)), cat, turns[0]))
    if wanted is not None and not records:
        raise ValueError(f"{path} holds no prompt of categories {wanted}")
    if per_category is not None:
        if per_category < 1:
            raise ValueError(f"--per-category={per_category}: must be at least 1")
        records = [r for c in dict.fromkeys(c for _, c, _ in records)
                   for r in [r for r in records if r[1] == c][:per_category]]
    if n is None:
        return records
    if n < 1 or n > len(records):
        raise ValueError(f"--num-prompts={n}: {path} holds {len(records)} prompts")
    return records[:n]


def categories(path: str | Path | None = None) -> list[str]:
    """The categories of a prompt file (or set name), in order of first appearance."""
    return list(dict.fromkeys(cat for _, cat, _ in load_records(path)))


def add_prompt_arguments(parser: argparse.ArgumentParser, num_prompts: int = 10) -> None:
    """``--prompts`` and ``--num-prompts``, shared by both benchmarks."""
    parser.add_argument("--prompts", default=None,
                        help="'mt-bench' (default: the 80 MT-Bench questions shipped with specdec), 'varied' (50 "
                             "prompts shipped with specdec: translation, summarization, qa, math, rag), 'code' "
                             "(16 coding requests: completions, bug fixes, refactors), or an "
                             "MT-Bench style jsonl (first of 'turns' used)")
    parser.add_argument("--num-prompts", type=int, default=num_prompts,
                        help=f"first N questions (default {num_prompts})")
