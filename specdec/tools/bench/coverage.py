"""Coverage of the shipped drafts' reduced vocabulary on the target's own greedy outputs.

The shipped drafts for the embedded model propose only from a reduced vocabulary: 8,192 tokens for the
draft model, the EAGLE-1 head and the Medusa heads (``specdec/draft``, ``specdec/eagle``, ``specdec/medusa``
weights: ``output_token_ids`` / ``token_ids``), 12,288 for the EAGLE-3 head (its ``d2t``); a target token
outside that set can never be drafted. For each prompt category (MT-Bench first turns, and each category of the
varied set) this reports, on the target's greedy outputs (``--max-new-tokens``, EOS off):

- ``oov``: the share of output tokens outside each draft's vocabulary;
- ``oov_in_prompt``: of those, the share that occur in the row's own prompt (prompt lookup could propose
  them), and ``oov_in_context`` (in the prompt or earlier in the output: n-gram lookup over the context);
- ``coverage``: the share inside larger vocabularies V (16k / 24k / 32k / full), each = the first draft's
  8,192 tokens + the next V - 8,192 tokens in one of three orders:
    * ``merge_rank``: the lowest token ids not yet in (the tokenizer's BPE merge order, i.e. the frequency
      structure of the tokenizer's own training corpus; data-free);
    * ``other_categories``: the tokens by frequency in the target's outputs on every *other* category
      (leave-one-category-out, an honest held-out estimate of extending from generated data), then merge rank;
    * ``oracle``: the tokens by frequency in this category's own outputs (in-sample upper bound), then merge rank.
- the cost: LM-head bytes a draft reads per drafted token, hidden × V × 2 (bf16).

    specdec bench-coverage [--sets mt-bench,varied] [--max-new-tokens 128] [--output FILE]
    (default output bench/results/coverage.json; ``--cache FILE`` keeps the generated outputs)
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...options import options_from
from ..arguments import int_list
from . import runtime
from .prompts import load_records

SIZES = (8192, 16384, 24576, 32768)


OUTPUT = "bench/results/coverage.json"
"""Where the result goes without ``--output``."""


@dataclass(frozen=True)
class CoverageBenchOptions:
    """What ``run`` measures (the flags of ``add_arguments``, same names): ``sets`` (a comma list of prompt sets
    or jsonl files), their first ``num_prompts`` (None: all), ``max_new_tokens`` greedy tokens per prompt at
    ``amp``, ``batch_size`` prompts per call, the vocabulary ``sizes`` evaluated besides the full one, ``threads``
    (None: torch's), ``cache`` (a json of generated outputs: read if it exists, else written), ``output``
    (None: ``OUTPUT``)."""

    sets: str = "mt-bench,varied"
    num_prompts: int | None = None
    max_new_tokens: int = 128
    amp: str = "bf16"
    batch_size: int = 8
    sizes: list[int] = field(default_factory=lambda: list(SIZES))
    threads: int | None = None
    cache: str | None = None
    output: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sets", default="mt-bench,varied",
                        help="comma list of prompt sets ('mt-bench', 'varied') or MT-Bench style jsonl files")
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each set (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--amp", default="bf16", help="target precision for the greedy outputs (f32, bf16)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sizes", type=int_list, default=list(SIZES),
                        help="vocabulary sizes to evaluate besides the full one (default 8192,16384,24576,32768)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache", default=None, help="json of generated outputs: read if it exists, else written")
    parser.add_argument("--output", default=None, help="default bench/results/coverage.json")


def shipped_vocabularies() -> dict[str, torch.Tensor]:
    """The reduced vocabularies of the shipped drafts (token ids): the 8,192 of the draft model, the EAGLE-1
    head and the Medusa heads (``output_token_ids`` / ``token_ids``), and the EAGLE-3 head's 12,288
    (draft index i proposes target id i + ``d2t[i]``)."""
    from safetensors import safe_open

    from ...draft.smollm2 import shipped_draft_dir
    from ...eagle.checkpoint import eagle3_token_ids
    from ...eagle.smollm2 import shipped_eagle3_dir, shipped_eagle_dir
    from ...medusa.smollm2 import shipped_medusa_dir
    out = {}
    for name, path, key in (("draft", shipped_draft_dir() / "draft.safetensors", "output_token_ids"),
                            ("eagle", shipped_eagle_dir() / "model.safetensors", "output_token_ids"),
                            ("medusa", shipped_medusa_dir() / "medusa_lm_head.safetensors", "token_ids")):
        with safe_open(str(path), "pt") as f:
            out[name] = f.get_tensor(key).long()
    eagle3 = shipped_eagle3_dir()
    config = json.loads((eagle3 / "config.json").read_text())
    out["eagle3"] = eagle3_token_ids(eagle3, config["vocab_size"], config["draft_vocab_size"])
    return out


@torch.no_grad()
def generate_outputs(sets: list[str], num_prompts: int | None, max_new_tokens: int, amp: str, batch_size: int,
                     log=print) -> list[dict]:
    """Greedy outputs of the embedded model: one dict per prompt (set, question_id, category, prompt, output)."""
    from transformers import AutoTokenizer

    from ...core.chat import chat_ids
    from ...core.decoder import DecoderModel
    from ...core.paths import resolve_model_path
    from ...core.sampling import SamplingConfig
    rows = []
    for s in sets:
        for q, cat, text in load_records(s, num_prompts):
            rows.append({"set": s, "question_id": q, "category": cat, "text": text})
    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    for r in rows:
        r["prompt"] = chat_ids(tok, r["text"])
    longest = max(len(r["prompt"]) for r in rows)
    n_positions = -(-(longest + max_new_tokens) // 128) * 128
    model = DecoderModel.from_pretrained(None, batch_size=batch_size, n_positions=n_positions, amp=amp,
                                         backend="eager", sampling=SamplingConfig(do_sample=False), progress=False)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt"]))   # little padding per batch
    t0 = time.time()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        prompts = [rows[i]["prompt"] for i in idx]
        prompts += [prompts[-1]] * (batch_size - len(prompts))
        out = model.generate(prompts, max_new_tokens=max_new_tokens, eos_token_id=[])
        for j, i in enumerate(idx):
            rows[i]["output"] = out[j, -max_new_tokens:].tolist()
        log(f"generated {min(b + batch_size, len(order))}/{len(order)} ({time.time() - t0:.0f} s)")
    return rows


def extension_orders(rows: list[dict], base: torch.Tensor, vocab_size: int) -> dict[str, dict[str, list[int]]]:
    """Per category and strategy, the token ids added after ``base`` in order (all of the vocabulary)."""
    in_base = set(base.tolist())
    merge = [t for t in range(vocab_size) if t not in in_base]
    cats = sorted({(r["set"], r["category"]) for r in rows})

    def by_frequency(counter: Counter) -> list[int]:
        first = [t for t, _ in counter.most_common() if t not in in_base]
        seen = set(first)
        return first + [t for t in merge if t not in seen]

    orders = {}
    for c in cats:
        own = Counter(t for r in rows if (r["set"], r["category"]) == c for t in r["output"])
        other = Counter(t for r in rows if (r["set"], r["category"]) != c for t in r["output"])
        orders["/".join(c)] = {"merge_rank": merge, "other_categories": by_frequency(other),
                               "oracle": by_frequency(own)}
    return orders


def membership(vocab_size: int, *ids: torch.Tensor) -> torch.Tensor:
    """[vocab_size] bool: True at every token id in ``ids``."""
    member = torch.zeros(vocab_size, dtype=torch.bool)
    for t in ids:
        member[t] = True
    return member


def analyse(rows: list[dict], vocabs: dict[str, torch.Tensor], sizes: list[int], vocab_size: int,
            hidden: int) -> dict:
    base = next(iter(vocabs.values()))        # the larger vocabularies extend the first draft's
    identical = all(torch.equal(torch.sort(v).values, torch.sort(base).values) for v in vocabs.values())
    orders = extension_orders(rows, base, vocab_size)
    sizes = sorted({s for s in sizes if s <= vocab_size} | {vocab_size})
    result = {"drafts_share_one_vocabulary": identical, "draft_vocab_sizes": {k: len(v) for k, v in vocabs.items()},
              "lm_head_bytes_per_draft_token_bf16": {str(s): hidden * s * 2 for s in sizes}, "categories": {}}
    groups = {}
    for r in rows:
        groups.setdefault(f"{r['set']}/{r['category']}", []).append(r)
    for s in dict.fromkeys(r["set"] for r in rows):
        groups[f"{s}/ALL"] = [r for r in rows if r["set"] == s]
    for name, rs in groups.items():
        n = sum(len(r["output"]) for r in rs)
        entry = {"prompts": len(rs), "tokens": n, "drafts": {}, "coverage": {}}
        for d, ids in vocabs.items():
            member = membership(vocab_size, ids)
            oov = in_prompt = in_context = 0
            for r in rs:
                prompt = set(r["prompt"])
                for j, t in enumerate(r["output"]):
                    if not member[t]:
                        oov += 1
                        in_prompt += t in prompt
                        in_context += t in prompt or t in r["output"][:j]
            entry["drafts"][d] = {"oov": oov / n, "oov_tokens": oov, "oov_in_prompt": in_prompt / max(oov, 1),
                                  "oov_in_context": in_context / max(oov, 1),
                                  "oov_not_in_prompt_share_of_output": (oov - in_prompt) / n}
        cats = [name] if not name.endswith("/ALL") else [k for k in orders if k.startswith(name[:-3])]
        for strategy in ("merge_rank", "other_categories", "oracle"):
            cov = {}
            for s in sizes:
                hits = 0
                for c in cats:
                    member = membership(vocab_size, base, torch.tensor(orders[c][strategy][: max(0, s - len(base))],
                                                                        dtype=torch.long))
                    hits += sum(int(member[t]) for r in rs if f"{r['set']}/{r['category']}" == c for t in r["output"])
                cov[str(s)] = hits / n
            entry["coverage"][strategy] = cov
        result["categories"][name] = entry
    return result


def table(result: dict) -> str:
    """Markdown: per category, the first draft's OOV (with the shares lookup could copy), the OOV of each
    draft with a vocabulary of another size, and the coverage of the larger vocabularies."""
    sizes = list(result["lm_head_bytes_per_draft_token_bf16"])
    vocab = result["draft_vocab_sizes"]
    first, *rest = vocab
    others = [d for d in rest if vocab[d] != vocab[first]]
    lines = [f"| category | tokens | OOV {first} ({vocab[first]:,}) | OOV in prompt | OOV in context | " +
             "".join(f"OOV {d} ({vocab[d]:,}) | " for d in others) +
             " | ".join(f"{int(s) // 1024}k merge / other / oracle" if s != sizes[-1] else f"full {int(s):,}"
                        for s in sizes[1:]) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(others) + "---|" * (len(sizes) - 1)]
    for name, e in result["categories"].items():
        d = e["drafts"][first]
        cells = [" / ".join(f"{e['coverage'][st][s]:.3f}" for st in ("merge_rank", "other_categories", "oracle"))
                 for s in sizes[1:]]
        lines.append(f"| {name} | {e['tokens']} | {d['oov']:.3f} | {d['oov_in_prompt']:.2f} | "
                     f"{d['oov_in_context']:.2f} | "
                     + "".join(f"{e['drafts'][o]['oov']:.3f} | " for o in others) + " | ".join(cells) + " |")
    lines.append("")
    lines.append("LM-head bytes per draft token (bf16): " + ", ".join(
        f"{int(s)}: {b / 1e6:.1f} MB" for s, b in result["lm_head_bytes_per_draft_token_bf16"].items()))
    return "\n".join(lines)


def run(options: CoverageBenchOptions) -> dict:
    if options.threads:
        torch.set_num_threads(options.threads)
    from ...core.config import ModelConfig
    from ...core.paths import resolve_model_path
    sets = [s for s in options.sets.split(",") if s]
    cache = Path(options.cache) if options.cache else None
    if cache is not None and cache.is_file():
        rows = json.loads(cache.read_text())["rows"]
    else:
        rows = generate_outputs(sets, options.num_prompts, options.max_new_tokens, options.amp, options.batch_size)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps({"rows": rows}))
    config = ModelConfig.from_dir(resolve_model_path(None))
    result = {"benchmark": "coverage", "model": "SmolLM2-135M-Instruct (embedded)", "sets": sets,
              "max_new_tokens": options.max_new_tokens, "amp": options.amp, "decoding": "greedy, EOS off",
              **analyse(rows, shipped_vocabularies(), options.sizes, config.vocab_size, config.hidden_size)}
    return result


def print_result(result: dict, output: str | None = None) -> int:
    """JSON to stdout and to ``output`` (None: ``OUTPUT``), the table to stderr."""
    return runtime.print_result(result, output or OUTPUT, table)


def parse_options(argv: list[str] | None = None) -> CoverageBenchOptions:
    """``python -m specdec.tools.bench.coverage``'s arguments (``argv`` None: ``sys.argv``) as options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return options_from(CoverageBenchOptions, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    return print_result(run(options), options.output)


if __name__ == "__main__":
    raise SystemExit(main())
