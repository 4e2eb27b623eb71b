"""Training data for a draft: the target's own answers to prompts the target itself wrote.

Per batch of ``batch_size`` rows (seeded by ``seed`` and the batch index):
  1. a meta-prompt per row ("Write a question a user might ask an AI assistant about <topic>"), with a
     topic/task drawn from :data:`TASKS` (MT-Bench-like categories, none of its questions), is answered
     by the target with sampling → a user request;
  2. the request, in the target's chat template, is answered by the target through specdec's runtime
     (greedy for most rows, temperature sampling for a fraction), up to ``max_new_tokens``;
  3. labels: the target's argmax next token and top-16 distribution at every position of prompt +
     answer, from one prefill (:func:`label_sequences`, which labels any token sequences), so greedy
     rows are argmax distillation and sampled rows add off-greedy contexts.
The tokens of each batch are kept as a shard of a token store (``specdec.train.store``: compact
uint16 ids, e.g. the repository's ``specdec/train/tokens/smollm2-135m-instruct``); a run finds the
shards already there and only labels them. The labelled batch is written to ``<out>/batch_NNNNN.pt``
(tmp file + rename: Ctrl-C safe); a restart skips finished batches. :func:`label_store` makes the
same files from a store alone (no generation), :func:`load_dataset` concatenates them.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..core.chat import chat_ids
from .distill import save_atomic
from .prompts import build_requests, plan_rows, written_digest, written_requests
from .store import Shard, read_shard, shard_name, write_shard

@dataclass
class DataConfig:
    num_prompts: int = 4096
    batch_size: int = 128
    max_new_tokens: int = 256
    max_question_tokens: int = 64
    question_temperature: float = 0.9
    sample_fraction: float = 0.25   # rows answered with temperature sampling (the rest greedy)
    answer_temperature: float = 0.7
    seed: int = 0
    amp: str = "bf16"
    backend: str = "compiled"   # batch-128 bf16 decoding (AMX on this CPU class)
    global_topk: int = 1024   # sampled rows draw from the target's top-1024 (see SamplingConfig)
    prompts: str = "topics"   # the request mix (specdec.train.prompts): "topics", "tasks" or "written"
    max_prompt_tokens: int = 200   # longer requests are cut to fit (chat template included)
    requests_file: str | None = None   # the "written" mix's requests (None: specdec/train/requests.jsonl)


ADDED_LATER = {"prompts": "topics", "max_prompt_tokens": 200}
"""``DataConfig`` fields added after the first store was made, left out of a shard's settings at these
(their first) values so older shards keep matching."""


TOPK = 16


@torch.no_grad()
def prefill_hidden(model, sequences: list[torch.Tensor], progress: bool = False, desc: str = "prefill"):
    """The hidden states of every position of token sequences, by teacher-forced prefill: yields
    ``(i, hidden [len(sequences[i]), F])`` (F = H, or H·(1+A) with the model's ``feature_layers``).

    ``model``: a ``DecoderModel`` (its decoder's own math and dtype, eager; its KV cache is used as
    scratch and reset at the end). Sequences go longest-first in chunks of ``model.batch_size`` rows,
    each chunk padded only to its own longest row; each must fit ``model.n_positions``. The yielded
    tensors are views of the chunk's output: clone what is kept."""
    lm, B, dev = model.lm, model.batch_size, model.device
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    for s in tqdm(range(0, len(order), B), desc=desc, unit="batch", disable=not progress):
        chunk = order[s:s + B]
        L = len(sequences[chunk[0]])
        if L > model.n_positions:
            raise ValueError(f"a sequence of {L} tokens does not fit n_positions={model.n_positions}")
        ids = torch.zeros(B, L, dtype=torch.long)
        for j, i in enumerate(chunk):
            ids[j, : len(sequences[i])] = sequences[i]
        mask = torch.ones(L, L, dtype=torch.bool).tril().expand(B, L, L)
        _, hidden = lm(ids.to(dev), torch.arange(L).expand(B, L).to(dev), torch.zeros(B, dtype=torch.long, device=dev),
                       mask.to(dev), torch.zeros(B, 1, dtype=torch.long, device=dev), kv_len=L)
        for j, i in enumerate(chunk):
            yield i, hidden[j, : len(sequences[i])]
    model.reset()


@torch.no_grad()
def label_sequences(model, sequences: list[torch.Tensor], topk: int = TOPK):
    """Labels for any token sequences, by prefill only (``prefill_hidden``): the target's argmax next
    token at every position of each sequence, and its top-``topk`` next-token ids and probabilities
    (soft labels). Returns (labels [L] list, topk ids [L, k] int32 list, probs [L, k] f16 list), in
    ``sequences`` order. Generated answers (``generate_data``) and kept token data (``label_store``) are
    labelled with it; so can any other text (EAGLE-1: a fixed corpus trains a draft nearly as well as
    the target's own generations)."""
    lm = model.lm
    n = len(sequences)
    labels, top_ids, top_probs = [None] * n, [None] * n, [None] * n
    for i, h in prefill_hidden(model, sequences):
        ids_, probs_ = [], []
        for c in range(0, len(h), 256):
            p, t = lm.lm_head(h[c:c + 256]).float().softmax(-1).topk(topk, dim=-1)
            probs_.append(p.half().cpu())
            ids_.append(t.cpu())
        t = torch.cat(ids_)
        if lm.config.output_vocab_size:
            t = lm.output_token_ids.cpu()[t]
        labels[i] = t[:, 0].clone()
        top_ids[i] = t.to(torch.int32)
        top_probs[i] = torch.cat(probs_)
    return labels, top_ids, top_probs


def labelled_batch(model, tokens: list[torch.Tensor], prompt_lens: list[int], sampled: list[bool]) -> dict:
    """A data-set batch (``load_dataset``'s file format) from token rows: labels by prefill
    (``label_sequences``), and the share of greedy rows' answer tokens equal to the labels."""
    labels, top_ids, top_probs = label_sequences(model, tokens)
    greedy_agree = [float((lab[p - 1:-1] == r[p:]).float().mean()) for r, lab, p, s in
                    zip(tokens, labels, prompt_lens, sampled) if not s and len(r) > p]
    return {"tokens": tokens, "labels": labels, "topk_ids": top_ids, "topk_probs": top_probs,
            "prompt_lens": torch.tensor(prompt_lens, dtype=torch.long), "sampled": torch.tensor(sampled, dtype=torch.bool),
            "greedy_label_agreement": sum(greedy_agree) / max(len(greedy_agree), 1)}


def generate_tokens(model, cfg: DataConfig, index: int) -> Shard:
    """One batch of synthetic prompts + the target's answers, as token rows (deterministic in seed and
    index): a ``store.Shard`` whose meta holds the categories and the requests' text. The requests come
    from ``cfg.prompts``' mix (``specdec.train.prompts``): the target first answers each row's
    meta-prompt (sampled, up to ``max_question_tokens``), which becomes the request; the "written" mix's
    requests are taken as they are."""
    tok = model.tokenizer
    rng = random.Random(cfg.seed * 1_000_003 + index)
    n = min(cfg.batch_size, cfg.num_prompts - index * cfg.batch_size)
    plans = plan_rows(cfg.prompts, rng, n, first=index * cfg.batch_size, seed=cfg.seed, requests=cfg.requests_file)
    replies = [""] * n
    if cfg.prompts != "written":
        metas = [chat_ids(tok, p.meta) for p in plans]
        qs = model.generate(metas, max_new_tokens=cfg.max_question_tokens, do_sample=True,
                            temperature=cfg.question_temperature, top_p=0.95, seed=rng.randrange(2**31))
        width = max(len(m) for m in metas)
        replies = [tok.decode(qs[i, width:], skip_special_tokens=True) for i in range(n)]
    questions = build_requests(plans, replies)
    prompts = [torch.tensor(fit_request(tok, q, cfg.max_prompt_tokens)) for q in questions]
    sampled = [rng.random() < cfg.sample_fraction for _ in range(n)]
    temps = [cfg.answer_temperature if s else 0.0 for s in sampled] + [0.0] * (model.batch_size - n)
    out = model.generate(prompts, max_new_tokens=cfg.max_new_tokens, do_sample=any(sampled),
                         temperature=temps, seed=rng.randrange(2**31))
    width = max(len(p) for p in prompts)
    eos = set(model.config.eos_token_ids)
    rows, prompt_lens = [], []
    for i in range(n):
        ans = out[i, width:].tolist()
        cut = next((j + 1 for j, t in enumerate(ans) if t in eos), len(ans))
        rows.append(torch.cat([prompts[i], torch.tensor(ans[:cut], dtype=torch.long)]))
        prompt_lens.append(len(prompts[i]))
    return Shard(rows, prompt_lens, sampled, {"categories": [p.category for p in plans], "questions": questions})


def fit_request(tok, request: str, limit: int) -> list[int]:
    """The chat-template ids of ``request``, its text cut (by tokens, from the end) until they fit ``limit``."""
    ids = chat_ids(tok, request)
    if len(ids) <= limit:
        return ids
    body = tok.encode(request, add_special_tokens=False)
    ids = chat_ids(tok, tok.decode(body[: max(len(body) - (len(ids) - limit) - 2, 1)]))
    return ids[: limit - 1] + ids[-1:] if len(ids) > limit else ids


def generate_batch(model, cfg: DataConfig, index: int) -> dict:
    """One batch of synthetic prompts + answers + labels (deterministic in seed and index)."""
    shard = generate_tokens(model, cfg, index)
    batch = labelled_batch(model, shard.tokens, shard.prompt_lens, shard.sampled)
    return {**batch, "questions": shard.meta["questions"], "categories": shard.meta["categories"]}


def token_settings(cfg: DataConfig) -> dict:
    """The ``DataConfig`` fields generated tokens depend on (a store's shards must agree on them)."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("num_prompts", "backend", "requests_file")
                and not (k in ADDED_LATER and v == ADDED_LATER[k])}
    if cfg.prompts == "written":      # the file's content (not its path) decides what each row answered
        settings["requests"] = written_digest(cfg.requests_file)
    return settings


def generate_data(out_dir: str | Path, cfg: DataConfig, target_path=None, progress: bool = True,
                  store: str | Path | None = None) -> Path:
    """Generate (or finish generating) the dataset in ``out_dir``; returns it. Resumable.

    Per batch: the tokens (``generate_tokens``) are kept as a shard in the token store ``store``
    (default ``out_dir/tokens``; ``specdec.train.store``), unless it already holds that batch (same seed
    and settings), then labelled by prefill (``labelled_batch``) into ``out_dir/batch_NNNNN.pt``."""
    from ..core.decoder import DecoderModel
    from ..core.sampling import SamplingConfig

    out_dir = Path(out_dir)
    store = Path(store) if store is not None else out_dir / "tokens"
    available = len(written_requests(cfg.requests_file)) if cfg.prompts == "written" else None
    if available is not None and cfg.num_prompts > available:
        raise ValueError(f"num_prompts={cfg.num_prompts}, but the written mix holds {available} requests (each "
                         "seed answers each once): pass at most that many, and another seed for more")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = out_dir / "data_config.json"
    if meta.is_file():
        old = {**asdict(DataConfig()), **json.loads(meta.read_text())}   # fields added since: their defaults
        if {k: v for k, v in old.items() if k != "num_prompts"} != \
                {k: v for k, v in asdict(cfg).items() if k != "num_prompts"}:
            raise ValueError(f"{out_dir} holds data made with other settings ({old}); use another --out "
                             "or the same settings")
    meta.write_text(json.dumps(asdict(cfg), indent=2))
    n_batches = -(-cfg.num_prompts // cfg.batch_size)
    todo = [i for i in range(n_batches) if not (out_dir / f"batch_{i:05d}.pt").is_file()]
    if not todo:
        return out_dir
    prompt_room = max(256, cfg.max_prompt_tokens)
    n_pos = prompt_room + cfg.max_new_tokens
    model = DecoderModel.from_pretrained(target_path, batch_size=cfg.batch_size, n_positions=n_pos, amp=cfg.amp,
                                         backend=cfg.backend, progress=False,
                                         context_buckets=sorted({64, 128, 256, prompt_room}),
                                         # KV buckets every 64 slots: at batch 128 a decode step reads
                                         # 23 KB of K/V per row and slot (1.5 GB at 512), more than the
                                         # weights, so a tight bucket matters (README, draft training data)
                                         kv_buckets=sorted({*range(128, n_pos, 64), n_pos}),
                                         sampling=SamplingConfig(global_topk=cfg.global_topk))
    bar = tqdm(total=n_batches, initial=n_batches - len(todo), desc="generating data", unit="batch",
               disable=not progress)
    for i in todo:
        start = time.perf_counter()
        shard_file = store / shard_name(cfg.seed, i)
        if shard_file.is_file():
            shard = read_shard(shard_file)
            if shard.meta.get("settings") != token_settings(cfg):
                raise ValueError(f"{shard_file} was generated with other settings ({shard.meta.get('settings')}); "
                                 "use another store or the same settings")
        else:
            shard = generate_tokens(model, cfg, i)
            answer = sum(len(t) - p for t, p in zip(shard.tokens, shard.prompt_lens))
            shard.meta.pop("questions")   # the prompts' text: decodable from their tokens
            shard.meta.update(model=model.path.name, settings=token_settings(cfg), answer_tokens=answer,
                              seconds=round(time.perf_counter() - start, 1))
            write_shard(store, cfg.seed, i, shard, model.vocab_size)
        batch = labelled_batch(model, shard.tokens, shard.prompt_lens, shard.sampled)
        batch.update(categories=shard.meta.get("categories"), shard=shard_file.name,
                     seconds=time.perf_counter() - start)
        save_atomic(batch, out_dir / f"batch_{i:05d}.pt")
        bar.update()
        bar.set_postfix(tokens=sum(len(r) - p for r, p in zip(batch["tokens"], batch["prompt_lens"].tolist())),
                        s=f"{batch['seconds']:.0f}", agree=f"{batch['greedy_label_agreement']:.3f}")
    bar.close()
    return out_dir


def label_store(store: str | Path, out_dir: str | Path, target_path=None, progress: bool = True,
                amp: str = "bf16", batch_rows: int = 32) -> Path:
    """Training data from kept tokens, by prefill only: every shard of the token store ``store``
    (``specdec.train.store``) labelled (``labelled_batch``) into ``out_dir/batch_<shard>.pt``, the
    ``load_dataset`` format. Resumable (labelled shards are skipped); returns ``out_dir``."""
    from ..core.decoder import DecoderModel
    from .store import shard_files

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = shard_files(store)
    if not files:
        raise ValueError(f"{store} holds no token shards (answers-s<seed>-<batch>.npz)")
    todo = [f for f in files if not (out_dir / f"batch_{f.stem.removeprefix('answers-')}.pt").is_file()]
    if not todo:
        return out_dir
    shards = [(f, read_shard(f)) for f in todo]
    longest = max(len(t) for _, s in shards for t in s.tokens)
    model = DecoderModel.from_pretrained(target_path, batch_size=batch_rows, n_positions=max(longest, 2), amp=amp,
                                         backend="eager", progress=False)
    for f, shard in tqdm(shards, desc="labelling kept tokens", unit="shard", disable=not progress):
        batch = labelled_batch(model, shard.tokens, shard.prompt_lens, shard.sampled)
        batch.update(categories=shard.meta.get("categories"), shard=f.name)
        save_atomic(batch, out_dir / f"batch_{f.stem.removeprefix('answers-')}.pt")
    return out_dir


def load_dataset(data_dir: str | Path) -> list[dict]:
    """All rows: dicts with tokens [L], labels [L] (argmax next token at each position), prompt_len,
    sampled, and (soft labels) topk_ids [L, k] / topk_probs [L, k]."""
    rows = []
    for f in sorted(Path(data_dir).glob("batch_*.pt")):
        b = torch.load(f, weights_only=False)
        for i, (t, lab, p, s) in enumerate(zip(b["tokens"], b["labels"], b["prompt_lens"].tolist(),
                                                b["sampled"].tolist())):
            row = {"tokens": t, "labels": lab, "prompt_len": p, "sampled": s}
            if "topk_ids" in b:
                row["topk_ids"], row["topk_probs"] = b["topk_ids"][i], b["topk_probs"][i]
            rows.append(row)
    return rows
