"""Quality of a precision / quantization setting: perplexity on held-out text and greedy agreement.

For each ``--settings`` entry (``f32``, ``bf16``, ``int8`` / ``int4`` = bf16 activations with
quantized projections, ``gguf`` / ``gguf-f32`` = bf16 / f32 activations with the GGUF file's own blocks,
quantized to 8 bits inside the kernel) the embedded model (or ``--model``) scores ``--text`` (default:
``HELD_OUT``, prose written for this benchmark, none of it in the prompts or training data of the shipped
drafts) in windows of ``--window`` tokens: perplexity = exp(mean negative log-likelihood of every token
after the first of each window). It also decodes ``--max-new-tokens`` greedy tokens for the first
``--num-prompts`` MT-Bench questions and reports, against the first setting (the reference), the tokens
each output shares with the reference's before the first difference and the share of outputs identical.
JSON on stdout (``--output`` also writes it).

    specdec bench-quality [--settings bf16,int8] [--window 256]
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ...core.chat import chat_ids
from . import runtime
from .prompts import add_prompt_arguments, load_prompts, resolve_prompts

HELD_OUT = """\
The lighthouse keeper kept a ledger of every ship that passed the point, and over forty winters the
ledger grew into six volumes bound in grey cloth. Most entries were short: a name, a flag, the hour,
the direction of the wind. A few ran longer. In the third volume he described a schooner that
anchored in the bay for nine days while her crew mended a split mast with timber cut from the hill
behind the village, and he noted that the children of the village learned to splice rope by
watching them. In the fifth volume he wrote that the lamp had failed for eleven minutes during a
storm in March, and that he had kept a hand lantern burning in the gallery until the mechanism
turned again. When the service replaced the lamp with an automatic light, the volumes went to the
county archive, where a clerk indexed them by ship and by year.

Bread rises because yeast ferments the sugars in flour and releases carbon dioxide, which the
gluten network traps in small pockets. A cool, slow rise gives the enzymes time to break starch
into simpler sugars, so the crust browns more deeply and the crumb tastes sweeter. Too much water
makes a dough that spreads instead of rising; too little makes a dense loaf. Bakers adjust for the
flour they have, because flours absorb water differently depending on their protein content and on
how finely they were milled.

To estimate the height of a tree without climbing it, stand where the top of the tree appears at
an angle of forty-five degrees above the horizon. The distance from your feet to the trunk, plus
the height of your eyes above the ground, is then close to the height of the tree. Surveyors use
the same idea with more precise instruments and with angles other than forty-five degrees, taking
the tangent of the measured angle instead of assuming it equals one.
"""

SETTINGS = {"f32": ("f32", None), "bf16": ("bf16", None), "int8": ("bf16", "int8"), "int4": ("bf16", "int4"),
            "gguf": ("bf16", "gguf"), "gguf-f32": ("f32", "gguf")}


@dataclass(frozen=True)
class QualityBenchOptions:
    """What ``run`` measures (the flags of ``add_arguments``, same names): ``prompts`` / ``num_prompts`` (the
    greedy-agreement prompts), ``model`` (None: the embedded model), ``settings`` (a comma list of
    ``SETTINGS``; the first is the reference), ``text`` (a file to score; None: the built-in held-out text),
    ``window`` tokens per scored window, ``max_new_tokens`` per prompt, ``threads`` (None: torch's), ``output``."""

    prompts: str | None = None
    num_prompts: int = 10
    model: str | None = None
    settings: str = "bf16,int8"
    text: str | None = None
    window: int = 256
    max_new_tokens: int = 128
    threads: int | None = None
    output: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_prompt_arguments(parser, num_prompts=10)
    parser.add_argument("--model", default=None,
                        help="checkpoint, .gguf or a named model, e.g. qwen2.5-coder-1.5b-instruct (default: the "
                             "embedded model)")
    parser.add_argument("--settings", default="bf16,int8", help=f"comma list of {', '.join(SETTINGS)}")
    parser.add_argument("--text", default=None, help="a text file to score (default: the built-in held-out text)")
    parser.add_argument("--window", type=int, default=256, help="tokens per scored window")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default=None)


@torch.no_grad()
def perplexity(model, ids: list[int], window: int) -> float:
    """exp(mean NLL) of ``ids`` scored in windows of ``window`` tokens (each from an empty cache)."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start:start + window]])
        if chunk.shape[1] < 2:
            break
        model.reset()
        logits = model.step(chunk, model.sampling_params(), advance=False).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        nll -= float(logp.gather(1, chunk[0, 1:].unsqueeze(1)).sum())
        count += chunk.shape[1] - 1
    return math.exp(nll / count)


def run(options: QualityBenchOptions) -> dict:
    from ...core.decoder import DecoderModel

    if options.threads:
        torch.set_num_threads(options.threads)
    names = [s for s in options.settings.split(",") if s]
    bad = [s for s in names if s not in SETTINGS]
    if bad or not names:
        raise ValueError(f"unknown setting(s) {bad}: choose from {', '.join(SETTINGS)}")
    text = open(options.text, encoding="utf-8").read() if options.text else HELD_OUT
    questions = load_prompts(resolve_prompts(options.prompts), options.num_prompts)
    result: dict = {"benchmark": "quality", "window": options.window, "settings": {}}
    outputs: dict[str, list[list[int]]] = {}
    for name in tqdm(names, desc="settings", file=sys.stderr):
        amp, quantization = SETTINGS[name]
        model = DecoderModel.from_pretrained(options.model, n_positions=max(options.window, 512), amp=amp,
                                             quantization=quantization, backend="eager", progress=False)
        ids = list(model.tokenizer(text)["input_ids"])
        prompts = [chat_ids(model.tokenizer, q) for q in questions]
        outputs[name] = [model.generate([p], max_new_tokens=options.max_new_tokens,
                                        eos_token_id=[])[0, len(p):].tolist() for p in prompts]
        result["settings"][name] = {"amp": amp, "quantization": quantization, "tokens_scored": len(ids),
                                    "perplexity": perplexity(model, ids, options.window)}
    ref = names[0]
    for name in names:
        pairs = list(zip(outputs[name], outputs[ref]))
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in pairs]
        result["settings"][name]["greedy_agreement_vs_" + ref] = {
            "common_prefix_share": sum(prefix) / sum(len(y) for _, y in pairs),
            "prompts_identical": sum(x == y for x, y in pairs) / len(pairs),
            "common_prefix_tokens": prefix}
        result["settings"][name]["perplexity_vs_" + ref] = \
            result["settings"][name]["perplexity"] / result["settings"][ref]["perplexity"]
    return result


print_result = runtime.print_result      # JSON to stdout (and --output)
