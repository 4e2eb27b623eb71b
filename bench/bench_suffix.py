#!/usr/bin/env python
"""Suffix decoding on repetitive and non-repetitive workloads: τ, tok/s and the ratio to target-only,
offline (batch 1, requests one after the other) and through the HTTP server under concurrent streams.

Workloads (generated here, deterministic for a given ``--seed``; every request greedy, ending at EOS or
``--max-new-tokens``):

- ``agent``: multi-turn agent sessions (a coding agent that fixes failing tests with JSON actions): every
  turn re-sends the whole conversation, the agent's earlier outputs and the tool results included;
- ``extraction``: extraction requests filling the same JSON schema from different generated documents;
- ``refactor``: refactor requests over similar generated Python functions;
- ``mt-bench`` and ``varied``: the first turns of MT-Bench and of specdec's varied prompt set, the
  non-repetitive controls.

Systems: ``target`` (target-only decoding) and one per ``--strategies`` entry (registry names, default
``suffix,suffix+model``). Each (system, workload) starts with an empty suffix cache that then fills with
the workload's finished requests, as a server's does. Offline: one ``SpeculativeGenerator`` per (system,
workload) over one batch-1 target, after building every graph a request may use (compiling backends:
``specdec.options.precompile``) and an untimed warm-up request (with its own cache); the systems run each
request in turn (agent sessions turn by turn), their order alternating from one request to the next, so a
drift of the machine's speed between requests reaches every system alike; ``tok_s`` = new tokens / seconds
of the ``generate`` calls (prefill included). Server (``--modes server``): ``specdec serve``'s
engine (batch ``--concurrency``) in this process, one server per system, all loaded at once and run on each
workload in turn (their order alternating from one workload to the next), ``--concurrency`` concurrent
streams (agent: that many sessions at once, each turn after the previous one; others: a closed loop of that
many clients);
``tok_s`` = output tokens / wall seconds. τ = 1 + accepted / steps (pooled row-steps). ``--prefix-cache``: every
system's target (and draft) keeps a row's KV for the next prompt starting with it; offline, where the systems
share one target, each request first finds the row as the system's own previous request left it (``timed``), and
the result counts each system's prompt tokens and those kept (``prompt_tokens``, ``prompt_tokens_kept``).
Greedy outputs of every speculative system must equal the target's (``identical_to_target``, in both modes).

Commands (the full runs take a while: run them on an idle machine)::

    python bench/bench_suffix.py                            # the embedded SmolLM2-135M-Instruct
    python bench/bench_suffix.py --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \\
        --quantization gguf

The JSON (stdout and ``--output``, default ``bench/results/suffix_<model>.json``): ``command``, ``commit``,
``machine`` (``specdec.tools.bench.runtime.machine_info``), ``config``, ``offline`` and ``server``
({workload: {system: {tau, tok_s, ratio_to_target, new_tokens, requests, seconds, cache, ...}}}); a markdown
table goes to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specdec import DecoderModel, Engine
from specdec.core.chat import chat_ids, conversation_ids
from specdec.core.named_models import is_named_model
from specdec.generator import SpeculativeGenerator
from specdec.options import (
    DRAFT_QUANTIZATIONS,
    EMBEDDED_NAME,
    SUFFIX_SETTINGS,
    ModelOptions,
    SpeculationOptions,
    available_cores,
    options_from,
    precompile,
)
from specdec.registry import REGISTRY, name_list
from specdec.serving.server import ServeOptions
from specdec.tools.arguments import add_suffix_arguments, draft_p_min_value, int_list, positive_int
from specdec.tools.bench import emit_json
from specdec.tools.bench.prompts import load_records
from specdec.tools.bench.runtime import git_commit, machine_info

WORKLOADS = ("agent", "extraction", "refactor", "mt-bench", "varied")
SUFFIX = tuple(name for name, s in REGISTRY.items() if s.suffix is not None)
"""The registry's suffix strategies (suffix alone, suffix+X): what ``--strategies`` may name."""
TARGET = "target"


@dataclass(frozen=True)
class SuffixBenchOptions:
    """What the benchmark runs (the flags of ``parse_args``, same names): the target ``model`` and the
    ``draft_model`` of suffix+model (None: the shipped draft) scoring ``draft_vocab`` ids (None: all) with its own
    weight-only ``draft_quantization`` (None: the target's), confidence stop ``draft_p_min`` (None: none) and
    window ``draft_window`` (None: none), the suffix ``strategies``, the ``workloads``, the ``modes`` (offline,
    server), ``requests`` per workload (agent: sessions of ``turns`` requests), ``max_new_tokens`` per request, the
    server's ``concurrency`` and ``rows`` (its batch; None: ``concurrency``), ``ks`` (each strategy once per k,
    named ``<strategy>-k<k>`` when there are several; None: the strategy's own k), ``gate`` (every speculative
    system with the cost gate: ``gate=True``, ``specdec.gate``),
    the runtime (``backend``, ``amp``, ``quantization``, ``n_positions``, ``context_buckets``, ``prompt_weights``,
    ``prefix_cache``, ``prefix_cache_mb``, ``threads``),
    the workloads' ``seed``, ``output`` (None: bench/results/suffix_<model>.json) and the suffix options
    (``SpeculationOptions``' suffix fields)."""

    model: str = EMBEDDED_NAME
    draft_model: str | None = None
    draft_vocab: int | None = None
    draft_quantization: str | None = None
    draft_p_min: float | None = None
    draft_window: int | None = None
    strategies: list[str] = field(default_factory=lambda: ["suffix", "suffix+model"])
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    modes: list[str] = field(default_factory=lambda: ["offline", "server"])
    requests: int = 8
    turns: int = 4
    max_new_tokens: int = 128
    concurrency: int = 4
    rows: int | None = None
    ks: list[int] | None = None
    gate: bool = False
    backend: str = "eager"
    amp: str = "f32"
    quantization: str | None = None
    n_positions: int = 2048
    context_buckets: list[int] | None = None
    prompt_weights: str | None = None
    prefix_cache: bool = False
    prefix_cache_mb: list[int] = field(default_factory=lambda: [1024])
    threads: int = field(default_factory=available_cores)
    seed: int = 0
    output: str | None = None
    suffix_cache_tokens: int | None = None
    suffix_alpha: float | None = None
    suffix_min_prob: float | None = None
    suffix_min_match: int | None = None


def systems_of(cfg: SuffixBenchOptions) -> dict[str, tuple[str, int | None, int]]:
    """The systems a run compares → {name: (registry strategy, k (None: the strategy's own), prefix store MiB)}:
    target-only first, then each strategy once per k of ``cfg.ks`` (named ``<strategy>-k<k>`` when there are
    several), all of them once per prefix store size of ``cfg.prefix_cache_mb`` (named ``<system>-store<mb>``
    past the first)."""
    ks = cfg.ks or [None]
    out: dict[str, tuple[str, int | None, int]] = {}
    for i, mb in enumerate(cfg.prefix_cache_mb):
        tail = f"-store{mb}" if i else ""
        out[TARGET + tail] = ("none", None, mb)
        for strategy in cfg.strategies:
            for k in ks:
                out[(strategy if len(ks) == 1 else f"{strategy}-k{k}") + tail] = (strategy, k, mb)
    return out


# ---------------------------------------------------------------------------------------------- workloads
FIRST = ["Maria", "James", "Aiko", "Omar", "Lena", "Pedro", "Grace", "Ivan", "Chen", "Sofia", "Noah", "Amara"]
LAST = ["Lopez", "Smith", "Tanaka", "Haddad", "Fischer", "Silva", "Okafor", "Petrov", "Wei", "Rossi", "Berg", "Diallo"]
COMPANIES = ["Acme Corp", "Globex", "Initech", "Umbrella Labs", "Stark Logistics", "Wayne Foods", "Hooli",
             "Vandelay Imports"]
ROLES = ["data analyst", "software engineer", "product manager", "accountant", "sales director", "nurse",
         "mechanical engineer", "designer"]
CITIES = ["Denver", "Lyon", "Osaka", "Nairobi", "Toronto", "Porto", "Austin", "Krakow"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
SCHEMA = ('{"name": string, "company": string, "role": string, "city": string, "start_date": "YYYY-MM-DD", '
          '"salary_usd": number, "remote": boolean}')
DOCUMENTS = [
    "{name} joined {company} as a {seniority} {role} in {city} on {month} {day}, {year}. The offer letter lists "
    "an annual salary of ${salary:,} and says the position is {remote_text}.",
    "HR note: starting {month} {day}, {year}, {company} employs {name} ({seniority} {role}). Work location: "
    "{city}, {remote_text}. Compensation: ${salary:,} per year.",
    "Welcome aboard! {company} is happy to announce that {name} starts as our new {seniority} {role} on "
    "{month} {day}, {year}. {first} will be based in {city} ({remote_text}) and earn ${salary:,} a year.",
]
ENTITIES = [("user", "users", ["email", "name", "id"]), ("order", "orders", ["customer_id", "status", "id"]),
            ("product", "products", ["sku", "category", "id"]), ("invoice", "invoices", ["number", "client", "id"]),
            ("ticket", "tickets", ["priority", "assignee", "id"]), ("book", "books", ["isbn", "author", "id"])]
FUNCTIONS = [
    "def find_{entity}_by_{field}({table}, value):\n    result = None\n    for item in {table}:\n"
    "        if item[\"{field}\"] == value:\n            result = item\n            break\n    return result\n",
    "def count_{table}_with_{field}({table}, value):\n    count = 0\n    for item in {table}:\n"
    "        if item[\"{field}\"] == value:\n            count = count + 1\n    return count\n",
    "def {table}_{field}_values({table}):\n    values = []\n    for item in {table}:\n"
    "        if item[\"{field}\"] not in values:\n            values.append(item[\"{field}\"])\n    return values\n",
]
REFACTOR = ("Refactor this Python function: add type hints and a docstring, and make it shorter with a generator "
            "expression or a comprehension. Reply with the code only.\n\n```python\n{code}```")
AGENT_SYSTEM = ("You are a coding agent fixing a failing test in a Python repository. Each turn, reply with one "
                "JSON action and nothing else: {\"thought\": string, \"tool\": \"read_file\" | \"run_tests\" | "
                "\"edit_file\" | \"finish\", \"args\": object}. Tool results come back as the next message.")
AGENT_TASK = ("Task: the test {test} fails in the repository {repo}. Find the bug in {module} and fix it.\n"
              "Files:\n{files}")


@dataclass
class Workload:
    """A workload: independent requests (``prompts``: token ids), or agent ``sessions`` whose turn t's prompt
    is the conversation so far (``turn(session, outputs)`` → the next prompt's ids, or None when it is over)."""

    name: str
    prompts: list[list[int]] = field(default_factory=list)
    sessions: list[Callable[[list[str]], list[int] | None]] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.prompts) or len(self.sessions)


def extraction_prompts(rng: random.Random, n: int) -> list[str]:
    """``n`` requests to fill ``SCHEMA`` from generated documents (different people, the same schema)."""
    out = []
    for _ in range(n):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        remote = rng.random() < 0.5
        doc = rng.choice(DOCUMENTS).format(
            name=f"{first} {last}", first=first, company=rng.choice(COMPANIES), role=rng.choice(ROLES),
            seniority=rng.choice(["junior", "senior", "lead"]), city=rng.choice(CITIES), month=rng.choice(MONTHS),
            day=rng.randint(1, 28), year=rng.randint(2015, 2024), salary=rng.randrange(40_000, 160_000, 500),
            remote_text="fully remote" if remote else "on site")
        out.append(f"Extract the fields of this document as a JSON object with exactly this schema: {SCHEMA}. "
                   f"Answer with the JSON object only.\n\nDocument: {doc}")
    return out


def refactor_prompts(rng: random.Random, n: int) -> list[str]:
    """``n`` refactor requests over generated functions of a few shapes (similar code, different names)."""
    out = []
    for _ in range(n):
        entity, table, fields = rng.choice(ENTITIES)
        code = rng.choice(FUNCTIONS).format(entity=entity, table=table, field=rng.choice(fields))
        out.append(REFACTOR.format(code=code))
    return out


def agent_tool_result(rng: random.Random, turn: int, module: str, test: str) -> str:
    """A deterministic tool result for an agent's turn: a file, a test run, an edit confirmation."""
    entity, table, fields = rng.choice(ENTITIES)
    if turn % 3 == 1:
        code = rng.choice(FUNCTIONS).format(entity=entity, table=table, field=rng.choice(fields))
        return f"read_file {module}:\n```python\n{code}```"
    if turn % 3 == 2:
        passed = rng.randint(5, 40)
        return (f"run_tests: {passed} passed, 1 failed\nFAILED {test} - AssertionError: expected 2, got 1\n"
                f"  File \"{module}\", line {rng.randint(3, 9)}, in count_{table}_with_{fields[0]}")
    return f"edit_file {module}: applied 1 change ({rng.randint(1, 4)} lines). Run the tests to check it."


def agent_session(tokenizer, rng: random.Random, turns: int) -> Callable[[list[str]], list[int] | None]:
    """A session of ``turns`` turns: the conversation grows by the agent's output and a tool result per turn."""
    entity, table, fields = rng.choice(ENTITIES)
    module = f"app/{table}.py"
    test = f"tests/test_{table}.py::test_count_{table}_with_{fields[0]}"
    files = "\n".join(f"  {p}" for p in (module, f"app/{rng.choice(ENTITIES)[1]}.py", "app/db.py",
                                         f"tests/test_{table}.py"))
    first = AGENT_TASK.format(test=test, repo=f"{entity}-service", module=module, files=files)
    results = [agent_tool_result(rng, t, module, test) for t in range(1, turns)]

    def turn(outputs: list[str]) -> list[int] | None:
        if len(outputs) >= turns:
            return None
        messages = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": first}]
        for i, out in enumerate(outputs):
            messages += [{"role": "assistant", "content": out}, {"role": "user", "content": results[i]}]
        return conversation_ids(tokenizer, messages)
    return turn


def workload(name: str, tokenizer, requests: int, turns: int, seed: int) -> Workload:
    """The workload ``name`` (``WORKLOADS``) with ``requests`` requests (agent: sessions of ``turns`` turns)."""
    rng = random.Random(f"{seed}-{name}")
    if name == "agent":
        return Workload(name, sessions=[agent_session(tokenizer, rng, turns) for _ in range(requests)])
    if name == "extraction":
        texts = extraction_prompts(rng, requests)
    elif name == "refactor":
        texts = refactor_prompts(rng, requests)
    else:
        texts = [text for _, _, text in load_records(name, requests)]
    return Workload(name, prompts=[chat_ids(tokenizer, t) for t in texts])


def interleaved(wl: Workload, tokenizer, systems: dict[str, Callable[[list[int]], list[int]]]) -> dict[str, list]:
    """Run every request of ``wl`` on every system in turn, request by request (agent sessions turn by turn),
    the systems' order alternating from one request to the next (A B, then B A), so that a drift of the
    machine's speed between requests reaches every system alike → {system: its outputs, in order}. Each
    system's agent turns hold its own earlier outputs (greedy systems agree, so the prompts are the same)."""
    names = list(systems)
    outputs: dict[str, list[list[int]]] = {name: [] for name in names}
    done = 0                                       # requests run so far: the next one's order

    def run(prompts: dict[str, list[int] | None]) -> None:
        nonlocal done
        for name in (names if done % 2 == 0 else names[::-1]):
            if prompts[name] is not None:
                outputs[name].append(systems[name](prompts[name]))
        done += 1

    for prompt in wl.prompts:
        run(dict.fromkeys(names, prompt))
    for session in wl.sessions:
        texts: dict[str, list[str]] = {name: [] for name in names}
        while True:
            prompts = {name: session(texts[name]) for name in names}
            if all(p is None for p in prompts.values()):
                break
            run(prompts)
            for name in names:
                if prompts[name] is not None:          # it ran this turn
                    texts[name].append(tokenizer.decode(outputs[name][-1], skip_special_tokens=True))
    return outputs


# ---------------------------------------------------------------------------------------------- offline
def run_offline(cfg: SuffixBenchOptions, workloads: list[Workload], target: DecoderModel) -> dict:
    """Batch 1: target-only and every strategy, per workload, the systems interleaved request by request
    (``interleaved``; see the module docstring) → {workload: {system: entry}}."""
    parts: dict[str, object] = {}           # a draft network, loaded once, serves every system that uses it

    def proposer(name: str):
        s = REGISTRY[name]
        if s.part is not None and s.part not in parts:
            overrides = speculation_options(cfg, name, None).draft_overrides()
            parts[s.part] = REGISTRY[s.part].build(target, cfg.draft_model, progress=False, **overrides)
        return s.build(target, part=parts.get(s.part), suffix=options_from(SpeculationOptions, cfg).suffix_settings())

    systems = systems_of(cfg)

    def generator(name: str) -> SpeculativeGenerator | None:
        strategy, k, _ = systems[name]
        if name == TARGET:
            return None
        return SpeculativeGenerator(proposer(strategy), target, k or REGISTRY[strategy].default_k, gate=cfg.gate)

    def engine_of(name: str) -> Engine:
        gen = generator(name)
        return Engine(target) if gen is None else gen.engine

    for system in systems:
        log(f"offline: preparing {system}")
        if cfg.backend != "eager":          # every graph a request may use, before anything is timed
            precompile(target, generator(system), cfg.n_positions - cfg.max_new_tokens, cfg.max_new_tokens)
        warm = engine_of(system)            # untimed: each workload's first request, a few tokens
        for wl in workloads:
            first = wl.prompts[0] if wl.prompts else wl.sessions[0]([])
            warm.generate([first], max_new_tokens=8)
    result: dict[str, dict] = {}
    for wl in workloads:
        log(f"offline: {wl.name}")
        engines = {system: engine_of(system) for system in systems}       # each with an empty cache
        seconds = dict.fromkeys(systems, 0.0)
        prompts = {s: [0, 0] for s in systems}
        runs = {s: timed(engines[s], s, seconds, cfg.max_new_tokens, prompts[s]) for s in systems}
        outputs = interleaved(wl, target.tokenizer, runs)
        result[wl.name] = {system: entry(engines[system], outputs[system], seconds[system]) for system in systems}
        for system, (tokens, kept) in prompts.items():
            result[wl.name][system].update(prompt_tokens=tokens, prompt_tokens_kept=kept)
    return finish(result)


def timed(engine: Engine, system: str, seconds: dict[str, float], max_new_tokens: int,
          prompts: list[int]) -> Callable[[list[int]], list[int]]:
    """``engine``'s batch-1 generation (prompt ids → new token ids), its time added to ``seconds[system]``, its
    prompt tokens and those the target's prefix cache kept to ``prompts`` [2].

    With ``prefix_cache`` the systems share one target, whose row holds what the system before left (the same
    request's prompt, from the system that ran it just before): so, untimed, each request first finds the row as
    this system's own previous request left it (its prompt and output but the last token, encoded in one go, the
    same for every system), as a server running this system alone would; the prefix store (``prefix_cache_mb``),
    which would hold the other systems' encodings, starts empty."""
    target, last = engine.target, []

    def generate(ids: list[int]) -> list[int]:
        if target.prefix_cache:
            target.reset()
            if target.prefix_store is not None:
                target.prefix_store.clear()
            if 0 < len(last) <= target.context_buckets[-1]:
                target.prefill([torch.tensor(last)], target.sampling_params(do_sample=False))
        kept = target.prompt_tokens_kept
        start = time.perf_counter()
        engine.generate([ids], max_new_tokens=max_new_tokens)
        seconds[system] += time.perf_counter() - start
        prompts[0] += len(ids)
        prompts[1] += target.prompt_tokens_kept - kept
        last[:] = (ids + engine.rows[0].new)[:-1]
        return list(engine.rows[0].new)
    return generate


COUNTERS = ("lookups", "hits", "added", "evicted")


def entry(engine: Engine, outputs: list[list[int]], seconds: float, before: dict | None = None) -> dict:
    """One (system, workload) result: requests, new tokens, seconds, tok/s, τ and acceptance (the engine's
    statistics since it was made or reset), the suffix cache's ``stats()`` (its counters since ``before``)."""
    new = sum(len(o) for o in outputs)
    out = {"requests": len(outputs), "new_tokens": new, "seconds": seconds, "tok_s": new / seconds,
           "outputs": outputs}
    speculator = engine.speculator
    if speculator is not None:
        d = engine.stats.to_dict()
        out.update(tau=d["mean_acceptance_length"], acceptance_rate=d["acceptance_rate"],
                   steps=d["steps"], drafted=d["drafted"], accepted=d["accepted"])
        if speculator.proposer.cache is not None:
            cache = speculator.proposer.cache.stats()
            cache.update({c: cache[c] - (before or {}).get(c, 0) for c in COUNTERS})
            cache["hit_rate"] = cache["hits"] / cache["lookups"] if cache["lookups"] else 0.0
            out["cache"] = cache
    return out


def finish(result: dict) -> dict:
    """Per workload: every system's ratio of tok/s to the target's and whether its outputs equal the target's
    (greedy: they must); the outputs themselves are dropped."""
    for systems in result.values():
        reference = systems[TARGET]
        for e in systems.values():
            e["ratio_to_target"] = e["tok_s"] / reference["tok_s"]
            e["identical_to_target"] = e["outputs"] == reference["outputs"]
        for e in systems.values():
            del e["outputs"]
    return result


# ---------------------------------------------------------------------------------------------- server
def speculation_options(cfg: SuffixBenchOptions, strategy: str, k: int | None) -> SpeculationOptions:
    """The options of ``strategy`` ("none": target only) drafting ``k`` tokens a step (None: the strategy's own):
    the draft flags for the draft network it has (``--draft-vocab``, ``--draft-p-min``, ``--draft-window``: a draft
    model only),
    the suffix flags for a suffix strategy (not yet ``checked``). The draft's quantization and confidence stop are
    given explicitly (the target's scheme and none where the flags are absent, as offline), so a named draft
    model's preset (``SpeculationOptions.checked``) does not apply."""
    s = REGISTRY[strategy]
    suffix = {name: getattr(cfg, name) for name in SUFFIX_SETTINGS} if s.suffix else {}
    draft_quantization = cfg.draft_quantization or cfg.quantization or "none"
    return SpeculationOptions(draft=strategy, draft_model=cfg.draft_model if s.part == "model" else None,
                              draft_vocab=cfg.draft_vocab if s.part == "model" else None,
                              draft_quantization=draft_quantization if s.quantizable else None,
                              draft_p_min=(cfg.draft_p_min or 0.0) if s.part == "model" else None,
                              draft_window=cfg.draft_window if s.part == "model" else None,
                              k=k if strategy != "none" else None,
                              gate=cfg.gate and strategy != "none", **suffix)


def serve_options(cfg: SuffixBenchOptions, strategy: str, k: int | None, prefix_cache_mb: int) -> ServeOptions:
    """``specdec serve``'s options for ``strategy`` drafting ``k`` tokens a step (``speculation_options``), batch
    ``--rows`` (default ``--concurrency``), a prefix store of ``prefix_cache_mb`` MiB with ``--prefix-cache``."""
    speculation = speculation_options(cfg, strategy, k)
    model = ModelOptions(model=cfg.model, backend=cfg.backend, amp=cfg.amp, n_positions=cfg.n_positions,
                         context_buckets=cfg.context_buckets, quantization=cfg.quantization or "none",
                         prompt_weights=cfg.prompt_weights, prefix_cache=cfg.prefix_cache,
                         prefix_cache_mb=prefix_cache_mb)
    return ServeOptions(model=model, speculation=speculation.checked(model), batch_size=cfg.rows or cfg.concurrency,
                        max_waiting=4 * cfg.concurrency)


async def serve_workload(base: str, wl: Workload, tokenizer, cfg: SuffixBenchOptions) -> tuple[list[list[int]], int]:
    """``wl`` through the HTTP API, ``--concurrency`` at a time (requests: a closed loop of that many clients;
    agent: that many sessions at once, each turn after the previous one) → (the outputs, their prompt tokens)."""
    import httpx

    gate = asyncio.Semaphore(cfg.concurrency)
    prompt_tokens = 0
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=cfg.concurrency + 2)) as client:
        async def complete(ids: list[int]) -> list[int]:
            nonlocal prompt_tokens
            prompt_tokens += len(ids)
            body = {"prompt": ids, "max_tokens": cfg.max_new_tokens, "temperature": 0}
            r = await client.post(f"{base}/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
            return r.json()["choices"][0]["token_ids"]

        async def request(ids: list[int]) -> list[list[int]]:
            async with gate:
                return [await complete(ids)]

        async def session(turn) -> list[list[int]]:
            outputs, texts = [], []
            async with gate:
                while (prompt := turn(texts)) is not None:
                    outputs.append(await complete(prompt))
                    texts.append(tokenizer.decode(outputs[-1], skip_special_tokens=True))
            return outputs

        done = await asyncio.gather(*[request(p) for p in wl.prompts], *[session(t) for t in wl.sessions])
    return [o for outs in done for o in outs], prompt_tokens


def run_server(cfg: SuffixBenchOptions, workloads: list[Workload]) -> dict:
    """Every system served at once in this process (``specdec serve``'s engine, one server each), each one's
    cache emptied before a workload; the systems run each workload in turn, their order alternating from one
    workload to the next (as offline, so a drift of the machine's speed reaches every system alike) →
    {workload: {system: entry}} (outputs compared across systems as offline)."""
    from specdec.serving import create_app
    from specdec.serving.server import load_engine, running_server, serving_engine

    result: dict[str, dict] = {}
    with ExitStack() as stack:
        served = {}
        for system, (strategy, k, mb) in systems_of(cfg).items():
            log(f"server: loading {system}")
            options = serve_options(cfg, strategy, k, mb)
            engine = serving_engine(load_engine(options), options.max_waiting)
            served[system] = (engine.engine, stack.enter_context(running_server(create_app(engine, "bench"))))
            for wl in workloads:                     # warm-up: each workload's first request, a few tokens
                first = wl.prompts[0] if wl.prompts else wl.sessions[0]([])
                asyncio.run(serve_workload(served[system][1], Workload("warm-up", prompts=[first]),
                                           engine.engine.target.tokenizer, replace(cfg, max_new_tokens=8)))
        for i, wl in enumerate(workloads):
            for system in list(served)[::1 if i % 2 == 0 else -1]:
                log(f"server: {system} on {wl.name}")
                core, base = served[system]
                cache = None if core.speculator is None else core.speculator.proposer.cache
                if cache is not None:
                    cache.clear()
                before = {} if cache is None else cache.stats()
                core.stats.reset()                   # (the engine thread is idle between workloads)
                kept = core.target.prompt_tokens_kept
                start = time.perf_counter()
                outputs, prompt_tokens = asyncio.run(serve_workload(base, wl, core.target.tokenizer, cfg))
                seconds = time.perf_counter() - start
                result.setdefault(wl.name, {})[system] = entry(core, outputs, seconds, before)
                result[wl.name][system].update(prompt_tokens=prompt_tokens,
                                               prompt_tokens_kept=core.target.prompt_tokens_kept - kept)
    return finish({name: {system: systems[system] for system in served} for name, systems in result.items()})


# ---------------------------------------------------------------------------------------------- main
def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> SuffixBenchOptions:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_NAME,
                   help="the target: the embedded model, a named model (qwen2.5-coder-1.5b-instruct), a .gguf file "
                        "or a checkpoint directory")
    p.add_argument("--draft-model", default=None,
                   help="the draft of suffix+model (a named model such as qwen2.5-coder-0.5b-instruct, a .gguf file "
                        "or a checkpoint directory; default: the shipped draft, trained for the embedded model)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="the draft model scores only token ids [0, N) (a smaller LM head; greedy output unchanged)")
    p.add_argument("--draft-quantization", default=None, choices=DRAFT_QUANTIZATIONS,
                   help="the draft network's own weight-only scheme (q4_0: a GGUF draft's blocks requantized to "
                        "Q4_0; default: the target's)")
    p.add_argument("--draft-p-min", type=draft_p_min_value, default=None, metavar="P",
                   help="the draft model's confidence stop: a row stops drafting after a token the draft gives a "
                        "probability below P (DraftModel's p_min)")
    p.add_argument("--draft-window", type=positive_int, default=None, metavar="W",
                   help="the draft model encodes at most W tokens of a row at once (DraftModel's window)")
    p.add_argument("--strategies", type=name_list(SUFFIX), default=["suffix", "suffix+model"],
                   help=f"comma list of {', '.join(SUFFIX)} (target-only always runs)")
    p.add_argument("--workloads", type=name_list_of(WORKLOADS), default=list(WORKLOADS), help="comma list")
    p.add_argument("--modes", type=name_list_of(("offline", "server")), default=["offline", "server"],
                   help="offline (batch 1), server (HTTP, --concurrency streams), or both")
    p.add_argument("--requests", type=int, default=8,
                   help="requests per workload (agent: sessions, each of --turns requests)")
    p.add_argument("--turns", type=int, default=4, help="agent: turns per session")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per request (a request may end at EOS first)")
    p.add_argument("--concurrency", type=int, default=4, help="server: concurrent streams")
    p.add_argument("--rows", type=int, default=None,
                   help="server: rows of the batch (default: --concurrency; fewer rows than agent sessions make "
                        "sessions share rows, where the prefix store keeps their prefixes)")
    p.add_argument("--ks", type=int_list, default=None,
                   help="draft tokens per step, a comma list: each strategy runs once per k, named <strategy>-k<k> "
                        "when there are several (default: the strategy's own k)")
    p.add_argument("--gate", action="store_true",
                   help="every speculative system with the cost gate (speculate only while it pays: gate=True)")
    p.add_argument("--backend", choices=("eager", "compiled", "regional"), default="eager")
    p.add_argument("--amp", choices=("f32", "bf16"), default="f32")
    p.add_argument("--quantization", default=None, choices=("int8", "int4", "gguf"),
                   help="the target's weights (gguf: a GGUF model's own blocks, e.g. the Qwen2.5-Coder pair)")
    p.add_argument("--n-positions", type=int, default=2048, help="KV positions: the longest agent turn must fit")
    p.add_argument("--context-buckets", type=int_list, default=None,
                   help="prompt-length buckets, e.g. 64,128,192,256,384,512,768,1024 (default: powers of two)")
    p.add_argument("--prompt-weights", default=None, choices=["bf16"],
                   help="GGML blocks (--quantization gguf): encode prompts with dense bf16 copies of the weights "
                        "(every system; DecoderModel.from_pretrained(prompt_weights=...))")
    p.add_argument("--prefix-cache", action="store_true",
                   help="every system keeps each row's KV for the next prompt starting with it (an agent's next "
                        "turn encodes its new tokens only; DecoderModel.from_pretrained(prefix_cache=True))")
    p.add_argument("--prefix-cache-mb", type=int_list, default=[1024], metavar="MB",
                   help="--prefix-cache: host memory keeping the prefixes rows give up (0: none); a comma list runs "
                        "every system once per size (server mode; named <system>-store<MB> past the first). Offline, "
                        "where the systems share one target, it starts empty for every request")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    p.add_argument("--seed", type=int, default=0, help="the workloads' generator seed")
    p.add_argument("--output", default=None,
                   help="also write the JSON here (default: bench/results/suffix_<model>.json)")
    add_suffix_arguments(p)
    args = p.parse_args(argv)
    if min(args.requests, args.turns, args.max_new_tokens, args.concurrency, args.rows or 1) < 1 or \
            min(args.prefix_cache_mb) < 0:
        p.error("--requests, --turns, --max-new-tokens, --concurrency and --rows must be >= 1, --prefix-cache-mb "
                ">= 0")
    args.prefix_cache_mb = list(dict.fromkeys(args.prefix_cache_mb))
    if len(args.prefix_cache_mb) > 1 and (args.modes != ["server"] or not args.prefix_cache):
        p.error("several --prefix-cache-mb sizes compare servers: use them with --prefix-cache --modes server")
    if args.ks is not None:
        if not args.ks or min(args.ks) < 1:
            p.error("--ks must list draft lengths >= 1")
        args.ks = list(dict.fromkeys(args.ks))
    if "suffix+model" in args.strategies and args.draft_model is None and args.model != EMBEDDED_NAME:
        p.error(f"suffix+model for --model {args.model} needs --draft-model (the shipped draft is for "
                f"{EMBEDDED_NAME})")
    return options_from(SuffixBenchOptions, args)


def name_list_of(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of ``choices``."""
    def parse(text: str) -> list[str]:
        out = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
        bad = [t for t in out if t not in choices]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"choose among {', '.join(choices)}, got {text!r}")
        return out
    return parse


def table(result: dict) -> str:
    """The markdown table of a result (a "prompt kept" column: the share of prompt tokens a prefix cache kept)."""
    entries = [e for mode in ("offline", "server") for systems in result.get(mode, {}).values()
               for e in systems.values()]
    kept = any(e.get("prompt_tokens_kept") for e in entries)
    rows = ["| mode | workload | system | τ | tok/s | × target | identical |" + (" prompt kept |" if kept else ""),
            "|---|---|---|---:|---:|---:|---|" + ("---:|" if kept else "")]
    for mode in ("offline", "server"):
        for wl, systems in result.get(mode, {}).items():
            for name, e in systems.items():
                tau = f"{e['tau']:.2f}" if "tau" in e else "1.00"
                share = f" {e['prompt_tokens_kept'] / e['prompt_tokens']:.0%} |" if "prompt_tokens_kept" in e else " |"
                rows.append(f"| {mode} | {wl} | {name} | {tau} | {e['tok_s']:.1f} | {e['ratio_to_target']:.2f} | "
                            f"{e['identical_to_target']} |" + (share if kept else ""))
    return "\n".join(rows)


def default_output(model: str) -> str:
    """``bench/results/suffix_<name>.json``: a named model's name whole (``qwen2.5-coder-1.5b-instruct``), a
    checkpoint path's file or folder name without its suffix."""
    name = model if model == EMBEDDED_NAME or is_named_model(model) else Path(model).stem
    return str(REPO / "bench" / "results" / f"suffix_{name}.json")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    torch.set_grad_enabled(False)
    output = cfg.output or default_output(cfg.model)
    result: dict = {"command": " ".join([sys.executable, *sys.argv]), "commit": git_commit(),
                    "machine": machine_info(), "config": {**asdict(cfg), "output": output}}
    log(f"loading {cfg.model} ...")
    target = DecoderModel.from_pretrained(cfg.model, batch_size=1, n_positions=cfg.n_positions,
                                          context_buckets=cfg.context_buckets, amp=cfg.amp,
                                          backend=cfg.backend, quantization=cfg.quantization,
                                          prompt_weights=cfg.prompt_weights, prefix_cache=cfg.prefix_cache,
                                          prefix_cache_mb=cfg.prefix_cache_mb[0],
                                          progress=False)
    workloads = [workload(w, target.tokenizer, cfg.requests, cfg.turns, cfg.seed) for w in cfg.workloads]
    longest = max(len(p) for wl in workloads for p in wl.prompts or [wl.sessions[0]([])])
    if longest + cfg.max_new_tokens > cfg.n_positions:
        raise SystemExit(f"--n-positions {cfg.n_positions} is too small for a prompt of {longest} tokens and "
                         f"{cfg.max_new_tokens} new tokens")
    if "offline" in cfg.modes:
        result["offline"] = run_offline(cfg, workloads, target)
    if "server" in cfg.modes:
        del target                                 # the servers load their own (batch --concurrency)
        result["server"] = run_server(cfg, workloads)
    emit_json(result, output)
    log(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
