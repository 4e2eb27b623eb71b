"""Acceptance-rate sweeps: strategies × k × temperature × prompts → one DataFrame row per prompt × configuration.

    from specdec import DecoderModel
    from specdec.tools.experiments import grid, mt_bench_prompts, sweep

    target = DecoderModel.from_pretrained(None, n_positions=512, backend="eager")
    configs = grid(["none", "model", "eagle", "medusa", "lookup"], ks=[2, 4], temperatures=[0.0, 0.7])
    df = sweep(target, configs, mt_bench_prompts(8), max_new_tokens=64, output="sweep.jsonl")

Runs: each configuration (``Config(strategy, k, temperature)``) runs its prompts in batches of the
target's ``batch_size`` (one ``Engine.generate`` call per batch). Every row's own ``SpecStats`` is
recorded from the same step results the engine records for the batch (``_RowStats``): the counts
(steps, drafted, accepted, emitted, per-position acceptance, histogram) of a batch's rows sum exactly to
the call's ``last_stats`` (checked after every batch). Times cannot be split between rows that run
together: a row's draft_s / verify_s / other_s are its batch's (so at batch size 1 a row IS the call's
``last_stats``, and a row's tokens_per_s is its share of the batch's throughput).

Resumable: with ``output`` (a JSONL file), each finished (configuration, batch) appends its rows (one
write, flushed and fsynced); a rerun with the same file skips every (configuration, prompt) it holds
for the same settings (model, amp, backend, batch size, max_new_tokens, seed, top_p, EOS), so an
interrupted sweep (Ctrl-C, a crash) resumes where it stopped. A torn last line (killed mid-write) is
dropped. Rows of other settings stay in the file and are not returned.

Suffix decoding learns across requests: a proposer with a cache (``suffix``, ``suffix+X``) starts every
configuration with it empty (after the warm-up), so a configuration never finds the outputs an earlier one
produced for the same prompts; within a configuration each batch finds the earlier batches' outputs
(a resumed configuration starts from an empty cache where it resumes).

Seeds: a row's seed is derived from ``seed`` and the prompt's id (``row_seed``), so a prompt samples the
same way whatever batch it lands in (rows are independent in the engine).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
import uuid
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...core.chat import chat_ids
from ...core.decoder import DecoderModel
from ...core.engine import Engine
from ...core.stats import SpecStats, _as_long
from ...registry import REGISTRY, RENAMED

__all__ = ["Config", "Prompt", "Strategy", "STRATEGIES", "grid", "mt_bench_prompts", "sweep", "summarize",
           "frame", "load_results", "row_seed"]

COUNTS = ("steps", "drafted", "accepted", "emitted")
TIMES = ("draft_s", "verify_s", "other_s")
# the DataFrame's columns, in order (then acc_pos_0, acc_pos_1, ... one per draft position)
COLUMNS = ["strategy", "k", "temperature", "prompt_id", "category", "prompt_tokens", "new_tokens",
           "tau", "acceptance_rate", "per_position_acceptance", "tokens_per_s", "steps", "drafted", "accepted",
           "emitted", "accepted_per_position", "accepted_histogram", "draft_s", "verify_s", "other_s", "total_s",
           "batch_id", "batch_size", "config", "max_new_tokens", "seed", "output_ids"]


def _pandas():
    try:
        import pandas as pd
    except ImportError as e:   # pragma: no cover - depends on the environment
        raise ImportError("specdec.tools.experiments needs pandas: pip install 'specdec[experiments]'") from e
    return pd


# ---------------------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class Config:
    """One configuration of a sweep.

    strategy: a name of the strategy registry (``specdec.registry``: "none", "model", "eagle", "medusa",
      "lookup", ...) or of the ``strategies`` passed to ``sweep`` (``grid`` / ``sweep`` refuse a name of
      neither, naming the new name of a renamed one: "target" → "none", "draft" → "model");
    k: draft tokens per step (chains); trees: their depth (Medusa: the shipped tree cut to it; EAGLE-2:
      the default dynamic tree at that depth; None: the whole default tree); "none": always 0
      (target-only decoding);
    temperature: 0 = greedy, else sampling at that temperature (top-k off, ``sweep``'s top_p).
    """

    strategy: str
    k: int | None = None
    temperature: float = 0.0

    def __post_init__(self):
        if not isinstance(self.strategy, str) or not self.strategy:
            raise ValueError(f"strategy must be a name, got {self.strategy!r}")
        k = self.k
        if self.strategy == "none":
            if k not in (None, 0):
                raise ValueError(f"strategy 'none' drafts nothing: k must be None or 0, got {k!r}")
            k = 0
        elif k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k must be a positive int (draft tokens per step), got {k!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}")
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "temperature", float(t))

    @property
    def key(self) -> str:
        """The configuration's identity in result files: ``strategy|k|temperature``."""
        return f"{self.strategy}|{self.k}|{self.temperature!r}"

    @property
    def label(self) -> str:
        k = "" if self.strategy == "none" else f" k={self.k}"
        return f"{self.strategy}{k} T={self.temperature:g}"


@dataclass(frozen=True)
class Strategy:
    """How a sweep builds a strategy's proposer for ``target``: ``build(target, k)`` (None: target-only).

    per_k: build one proposer per k (a Medusa tree per depth) instead of one for every k;
    max_k: the largest k the strategy supports (``grid`` drops larger ones), an int or a callable
      returning one (evaluated lazily), None = no limit.
    """

    build: Callable[[DecoderModel, int | None], Any] | None
    per_k: bool = False
    max_k: int | Callable[[], int] | None = None

    def k_limit(self) -> int | None:
        return self.max_k() if callable(self.max_k) else self.max_k


def _from_registry(name: str) -> Strategy:
    """A registry strategy as a sweep builds it: the shipped weights; a tree per k (its depth)."""
    found = REGISTRY[name]
    if not found.speculative:
        return Strategy(None)
    if found.kind == "tree":
        return Strategy(lambda target, k: found.build(target, depth=k), per_k=True, max_k=found.max_depth)
    return Strategy(lambda target, k: found.build(target))


STRATEGIES: dict[str, Strategy] = {name: _from_registry(name) for name in REGISTRY}
"""Every strategy of the registry (``specdec.registry``) by its name: "none" (target-only), the shipped
strategies of the embedded model (draft model, EAGLE heads, Medusa heads, as chains or trees), prompt lookup
(any target) and their combinations."""


def _registry(strategies: Mapping[str, Strategy | Callable] | None) -> dict[str, Strategy]:
    reg = dict(STRATEGIES)
    for name, s in (strategies or {}).items():
        reg[name] = s if isinstance(s, Strategy) else Strategy(s)
    return reg


def _unknown(name: str, reg: Mapping[str, Strategy]) -> str:
    if name in RENAMED:
        return f"strategy {name!r} is called {RENAMED[name]!r} now"
    return f"unknown strategy {name!r}; choose one of {', '.join(reg)}"


def grid(strategies: Iterable[str], ks: Iterable[int], temperatures: Iterable[float] = (0.0,), *,
         registry: Mapping[str, Strategy | Callable] | None = None) -> list[Config]:
    """Every strategy × k × temperature, temperature outermost. "none" gets one configuration per
    temperature (k = 0); a strategy with a ``max_k`` (Medusa: the shipped tree's depth) skips larger k."""
    reg = _registry(registry)
    ks = list(ks)
    configs = []
    for t in temperatures:
        for name in strategies:
            if name not in reg:
                raise ValueError(_unknown(name, reg))
            if name == "none":
                configs.append(Config("none", 0, t))
                continue
            limit = reg[name].k_limit()
            configs += [Config(name, k, t) for k in ks if limit is None or k <= limit]
    return configs


# ---------------------------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class Prompt:
    """A prompt of a sweep: its id, category (None: none), text (chat-templated with the target's
    tokenizer) and/or token ids (used as given)."""

    id: Any
    category: str | None = None
    text: str | None = None
    ids: tuple[int, ...] | None = field(default=None)

    def __post_init__(self):
        if self.text is None and self.ids is None:
            raise ValueError(f"prompt {self.id!r} has neither text nor ids")
        if self.ids is not None:
            object.__setattr__(self, "ids", tuple(int(t) for t in self.ids))


def _as_prompts(prompts: Iterable) -> list[Prompt]:
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, Prompt):
            out.append(p)
        elif isinstance(p, str):
            out.append(Prompt(i, None, p))
        elif isinstance(p, Mapping):
            out.append(Prompt(p.get("id", i), p.get("category"), p.get("text"), p.get("ids")))
        elif isinstance(p, Sequence) and len(p) == 3:
            pid, category, body = p
            if isinstance(body, str):
                out.append(Prompt(pid, category, body))
            else:
                out.append(Prompt(pid, category, None, body))
        else:
            raise ValueError(f"prompt #{i}: expected a Prompt, a string, a dict or (id, category, text), got {p!r}")
    ids = [p.id for p in out]
    if len(set(map(str, ids))) != len(ids):
        raise ValueError("prompt ids must be unique")
    return out


def mt_bench_prompts(n: int | None = None, *, categories: Iterable[str] | None = None,
                     path: str | os.PathLike | None = None) -> list[Prompt]:
    """MT-Bench first turns as ``Prompt(question_id, category, text)`` (the questions shipped with the
    package, or an MT-Bench style jsonl ``path``). ``n`` questions taken round-robin over the categories
    (n = 8: one per category), None = all; ``categories`` keeps only those."""
    from ..bench.prompts import resolve_prompts
    path = resolve_prompts(path)
    by_category: dict[str, list[Prompt]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                cat = rec.get("category", "none")
                by_category.setdefault(cat, []).append(
                    Prompt(rec.get("question_id", sum(map(len, by_category.values()))), cat, rec["turns"][0]))
    if categories is not None:
        keep = list(categories)
        missing = [c for c in keep if c not in by_category]
        if missing:
            raise ValueError(f"no MT-Bench category {missing}; there are {', '.join(by_category)}")
        by_category = {c: by_category[c] for c in keep}
    queues = list(by_category.values())
    total = sum(map(len, queues))
    if n is None:
        n = total
    if n < 1 or n > total:
        raise ValueError(f"n={n}: {path} holds {total} prompts" + (" in those categories" if categories else ""))
    out, i = [], 0
    while len(out) < n:
        out += [q[i] for q in queues if i < len(q)][: n - len(out)]
        i += 1
    return out


def row_seed(seed: int, prompt_id) -> int:
    """The sampling seed of a prompt's row: from ``seed`` and the prompt's id, not its batch position."""
    return zlib.crc32(f"{int(seed)}:{prompt_id}".encode())


# ---------------------------------------------------------------------------------------------- per-row stats
class _RowStats:
    """Records each row's own ``SpecStats`` during ``engine.generate``, from the very arguments of the
    engine's ``stats.update`` calls (the step results), by wrapping the engine's ``step``."""

    def __init__(self, engine: Engine, rows: int):
        self.engine, self.rows = engine, [SpecStats() for _ in range(rows)]

    def __enter__(self) -> list[SpecStats]:
        engine, rows, step = self.engine, self.rows, self.engine.step

        def recorded_step():
            stats = engine.stats          # the call's own SpecStats (generate swaps in a fresh one)
            update = stats.update

            def record(num_accepted, num_drafted, active=None, emitted=None):
                update(num_accepted, num_drafted, active=active, emitted=emitted)
                acc = _as_long(num_accepted)
                dr = _as_long(num_drafted, acc)
                act = (torch.ones_like(acc, dtype=torch.bool) if active is None
                       else torch.as_tensor(active).detach().to("cpu", torch.bool).flatten().expand(acc.numel()))
                em = None if emitted is None else _as_long(emitted)
                if em is not None and em.numel() != acc.numel():
                    raise RuntimeError("per-row statistics need the emitted tokens per row")
                for r, row in enumerate(rows):
                    row.update(acc[r:r + 1], dr[r:r + 1], active=act[r:r + 1],
                               emitted=None if em is None else em[r:r + 1])

            stats.update = record
            try:
                return step()
            finally:
                del stats.update

        engine.step = recorded_step
        return rows

    def __exit__(self, *exc) -> None:
        self.engine.__dict__.pop("step", None)


# ---------------------------------------------------------------------------------------------- result files
def _read_jsonl(path: Path) -> list[dict]:
    """Complete records of a result file; a torn last line is ignored, a bad line elsewhere warned about."""
    if not path.exists():
        return []
    records = []
    lines = path.read_text(encoding="utf-8").split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                warnings.warn(f"{path}: skipping a malformed line {i + 1}", stacklevel=3)
    return records


def _repair(path: Path) -> None:
    """Cut a torn last line (a run killed mid-write) so appends start on a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def _append(path: Path, records: list[dict]) -> None:
    text = "".join(json.dumps(r, allow_nan=True) + "\n" for r in records)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)          # one write per batch
        f.flush()
        os.fsync(f.fileno())


def load_results(path: str | os.PathLike):
    """Every row of a result file as a DataFrame (all settings), as ``sweep`` returns them."""
    return frame(_read_jsonl(Path(path)))


# ---------------------------------------------------------------------------------------------- frames
def frame(records: Sequence[dict]):
    """Records (result-file rows) → the sweep's DataFrame: ``COLUMNS`` then ``acc_pos_0..`` (NaN past a
    row's k)."""
    pd = _pandas()
    width = max((len(r["per_position_acceptance"]) for r in records), default=0)
    rows = []
    for r in records:
        row = {c: r.get(c) for c in COLUMNS}
        pos = r["per_position_acceptance"]
        row.update({f"acc_pos_{i}": (pos[i] if i < len(pos) else math.nan) for i in range(width)})
        rows.append(row)
    df = pd.DataFrame(rows, columns=COLUMNS + [f"acc_pos_{i}" for i in range(width)])
    return df


def stats_of(row) -> SpecStats:
    """A DataFrame row (or record) back as its ``SpecStats``."""
    get = row.get if hasattr(row, "get") else row.__getitem__
    return SpecStats(*(get(c) for c in COUNTS), list(get("accepted_per_position")),
                     list(get("accepted_histogram")), *(get(c) for c in TIMES))


def summarize(df):
    """One row per configuration (in order of appearance): counts pooled over the prompts (τ = 1 +
    Σ accepted / Σ steps, as ``SpecStats.merge``), times summed over batches (a batch's rows share its
    times), tokens_per_s = Σ emitted / Σ batch time, and ``speedup`` over target-only decoding at the
    same temperature (when the frame has it)."""
    pd = _pandas()
    out = []
    for key, g in df.groupby("config", sort=False):
        counts = SpecStats()
        for _, r in g.iterrows():
            s = stats_of(r)
            s.draft_s = s.verify_s = s.other_s = 0.0
            counts.merge(s)
        for _, r in g.drop_duplicates("batch_id").iterrows():
            counts.add_time(r["draft_s"], r["verify_s"], r["other_s"])
        d = counts.to_dict()
        first = g.iloc[0]
        row = {"strategy": first["strategy"], "k": first["k"], "temperature": first["temperature"],
               "config": key, "prompts": len(g), "new_tokens": int(g["new_tokens"].sum()),
               "tau": d["mean_acceptance_length"], "acceptance_rate": d["acceptance_rate"],
               "per_position_acceptance": d["per_position_acceptance"], "tokens_per_s": d["tokens_per_s"],
               **{c: d[c] for c in COUNTS}, "accepted_per_position": d["accepted_per_position"],
               "accepted_histogram": d["accepted_histogram"], **{c: d[c] for c in TIMES}, "total_s": d["total_s"]}
        row.update({f"acc_pos_{i}": p for i, p in enumerate(d["per_position_acceptance"])})
        out.append(row)
    s = pd.DataFrame(out)
    if len(s):
        base = s[s["strategy"] == "none"].set_index("temperature")["tokens_per_s"]
        base = base[~base.index.duplicated()]
        s["speedup"] = [r.tokens_per_s / base[r.temperature] if r.temperature in base.index and base[r.temperature]
                        else math.nan for r in s.itertuples()]
    return s


# ---------------------------------------------------------------------------------------------- the sweep
def _progress(total: int, initial: int, enabled):
    if enabled is False:
        return None
    if callable(enabled) and enabled is not True:
        return enabled(total=total, initial=initial, unit="prompt")
    try:
        import ipywidgets  # noqa: F401  (tqdm.auto's notebook bar needs it)
        from tqdm.auto import tqdm
    except ImportError:
        from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="prompt", desc="sweep")


def _sampling(config: Config, top_p: float) -> dict:
    if config.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": config.temperature, "top_k": 0, "top_p": top_p}


def _prompt_hash(ids: Sequence[int]) -> str:
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:16]


def sweep(target: DecoderModel, configs: Iterable[Config], prompts: Iterable, *, max_new_tokens: int = 64,
          output: str | os.PathLike | None = None, seed: int = 0, top_p: float = 1.0, stop_at_eos: bool = False,
          strategies: Mapping[str, Strategy | Callable] | None = None, warmup: bool = True, progress=True,
          on_batch: Callable[[list[dict]], None] | None = None):
    """Run every configuration on every prompt; returns the DataFrame (one row per prompt × configuration,
    configurations in the given order, prompts in the given order; see ``COLUMNS``).

    target: the ``DecoderModel`` (its ``batch_size`` = prompts per call); configs: ``Config`` objects
    (``grid``); prompts: ``Prompt`` objects (``mt_bench_prompts``), strings, or (id, category, text-or-ids)
    tuples; max_new_tokens: per prompt (EOS ignored unless ``stop_at_eos``, so every configuration
    generates the same number of tokens); output: a JSONL result file (resumable, see the module doc);
    seed: sampling seed (``row_seed`` per prompt); strategies: extra / replacement strategies by name
    (``Strategy`` or a callable ``(target, k) -> proposer``); warmup: one short untimed generation per
    configuration before its first timed batch; progress: a tqdm bar (False: none, or a tqdm-like class);
    on_batch: called with each finished batch's records (after they are written).
    """
    from ...generator import SpeculativeGenerator

    _pandas()     # fail before running anything
    configs = list(configs)
    if len({c.key for c in configs}) != len(configs):
        raise ValueError("configurations must be unique")
    prompts = _as_prompts(prompts)
    if not configs or not prompts:
        raise ValueError("a sweep needs at least one configuration and one prompt")
    reg = _registry(strategies)
    for c in configs:
        if c.strategy not in reg:
            raise ValueError(_unknown(c.strategy, reg))
        if reg[c.strategy].build is not None and c.k is None and not reg[c.strategy].per_k:
            raise ValueError(f"{c.label}: k (draft tokens per step) is required for a chain strategy")
    ids = [list(p.ids) if p.ids is not None else chat_ids(target.tokenizer, p.text) for p in prompts]
    for p, x in zip(prompts, ids):
        if len(x) + max_new_tokens > target.n_positions:
            raise ValueError(f"prompt {p.id!r} has {len(x)} tokens: with max_new_tokens={max_new_tokens} it needs "
                             f"{len(x) + max_new_tokens} positions, but n_positions={target.n_positions}")
    settings = {"model": Path(str(target.path)).name, "amp": target.settings.amp,
                "backend": target.settings.backend, "batch_size": target.batch_size,
                "max_new_tokens": int(max_new_tokens), "seed": int(seed), "top_p": float(top_p),
                "stop_at_eos": bool(stop_at_eos)}
    hashes = [_prompt_hash(x) for x in ids]

    path = Path(output) if output is not None else None
    done: dict[tuple[str, str, str], dict] = {}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _repair(path)
        for r in _read_jsonl(path):
            if r.get("settings") == settings:
                done[r["config"], str(r["prompt_id"]), r["prompt_hash"]] = r

    def key(c: Config, i: int) -> tuple[str, str, str]:
        return c.key, str(prompts[i].id), hashes[i]

    B = target.batch_size
    todo = [(c, [i for i in range(len(prompts)) if key(c, i) not in done]) for c in configs]
    total = len(configs) * len(prompts)
    bar = _progress(total, total - sum(len(t) for _, t in todo), progress)
    proposers: dict[tuple[str, int | None], Any] = {}
    eos = None if stop_at_eos else []
    try:
        for c, pending in todo:
            if not pending:
                continue
            strat = reg[c.strategy]
            cache = None
            if strat.build is None:
                engine, k = Engine(target), 0
            else:
                pkey = (c.strategy, c.k if strat.per_k else None)
                if pkey not in proposers:      # built once, reused by every k / temperature
                    proposers[pkey] = strat.build(target, c.k)
                gen = SpeculativeGenerator(proposers[pkey], target, c.k if not strat.per_k else None)
                engine, k, cache = gen.engine, gen.k, gen.proposer.cache
            sampling = _sampling(c, top_p)
            if bar is not None:
                bar.set_description(c.label)
            if warmup:
                engine.generate([ids[pending[0]]], max_new_tokens=min(8, max_new_tokens), eos_token_id=eos,
                                seed=seed, **sampling)
            if cache is not None:     # a cross-request cache (suffix decoding) starts each configuration empty
                cache.clear()
            for start in range(0, len(pending), B):
                batch = pending[start:start + B]
                with _RowStats(engine, len(batch)) as rows:
                    engine.generate([ids[i] for i in batch], max_new_tokens=max_new_tokens,
                                          eos_token_id=eos, seed=[row_seed(seed, prompts[i].id) for i in batch],
                                          **sampling)
                new = [row.new for row in engine.rows[:len(batch)]]
                records = _records(c, k, batch, prompts, ids, hashes, rows, new, engine.last_stats, settings)
                if path is not None:
                    _append(path, records)
                for i, r in zip(batch, records):
                    done[key(c, i)] = r
                if bar is not None:
                    bar.update(len(batch))
                if on_batch is not None:
                    on_batch(records)
    finally:
        if bar is not None:
            bar.close()
    return frame([done[key(c, i)] for c in configs for i in range(len(prompts))])


def _records(c: Config, k: int, batch: list[int], prompts: list[Prompt], ids: list[list[int]], hashes: list[str],
             rows: list[SpecStats], new: list[list[int]], last: SpecStats, settings: dict) -> list[dict]:
    """The batch's rows; their counts must sum to the call's ``last_stats`` (the engine's own numbers)."""
    pooled = SpecStats()
    for r in rows:
        pooled.merge(r)
    for name in COUNTS + ("accepted_per_position", "accepted_histogram"):
        a, b = getattr(pooled, name), getattr(last, name)
        if isinstance(a, list):
            a, b = [x for x in a], [x for x in b]
            n = max(len(a), len(b))
            a, b = a + [0] * (n - len(a)), b + [0] * (n - len(b))
        if a != b:
            raise RuntimeError(f"per-row statistics do not add up to the engine's ({name}: {a} != {b})")
    batch_id = uuid.uuid4().hex[:12]
    out = []
    for i, row, tokens in zip(batch, rows, new):
        row.add_time(last.draft_s, last.verify_s, last.other_s)   # rows of a batch share its times
        d = row.to_dict()
        out.append({
            "strategy": c.strategy, "k": k, "temperature": c.temperature, "prompt_id": prompts[i].id,
            "category": prompts[i].category, "prompt_tokens": len(ids[i]), "new_tokens": len(tokens),
            "tau": d["mean_acceptance_length"], "acceptance_rate": d["acceptance_rate"],
            "per_position_acceptance": d["per_position_acceptance"], "tokens_per_s": d["tokens_per_s"],
            **{n: d[n] for n in COUNTS}, "accepted_per_position": d["accepted_per_position"],
            "accepted_histogram": d["accepted_histogram"], **{n: d[n] for n in TIMES}, "total_s": d["total_s"],
            "batch_id": batch_id, "batch_size": len(batch), "config": c.key,
            "max_new_tokens": settings["max_new_tokens"], "seed": settings["seed"], "output_ids": list(tokens),
            "prompt_hash": hashes[i], "settings": settings, "time": time.time(),
        })
    return out
