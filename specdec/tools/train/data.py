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
The tokens of each batch are kept as a shard of a token store (``specdec.tools.train.store``: compact
uint16 ids, e.g. the repository's ``assets/specdec_assets/train/tokens/smollm2-135m-instruct``); a run finds the
shards already there and only labels them. The labelled batch is written to ``<out>/batch_NNNNN.pt``
(tmp file + rename: Ctrl-C safe); a restart skips finished batches. :func:`label_store` makes the
same files from a store alone (no generation), :func:`load_dataset` concatenates them.
"""
from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...core.chat import chat_ids
from .prompts import build_requests, plan_rows, written_digest, written_requests
from .store import Shard, read_shard, save_atomic, shard_name, write_shard


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
    prompts: str = "topics"   # the request mix (specdec.tools.train.prompts): "topics", "tasks" or "written"
    max_prompt_tokens: int = 200   # longer requests are cut to fit (chat template included)
    requests_file: str | None = None   # the "written" mix's requests (None: assets/specdec_assets/train/requests.jsonl)


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
            "prompt_lens": torch.tensor(prompt_lens, dtype=torch.long),
            "sampled": torch.tensor(sampled, dtype=torch.bool),
            "greedy_label_agreement": sum(greedy_agree) / max(len(greedy_agree), 1)}


@dataclass
class BatchPlan:
    """One batch's requests, ready to answer: chat-template prompt ids, whether each row samples (at
    ``answer_temperature``; else greedy), one seed per row, and the rows' categories and request text."""

    prompts: list[torch.Tensor]
    sampled: list[bool]
    seeds: list[int]
    categories: list[str]
    questions: list[str]

    def jobs(self, cfg: DataConfig) -> list[tuple[torch.Tensor, float, int]]:
        """``answer_stream`` jobs: (prompt, temperature, seed) per row."""
        return [(p, cfg.answer_temperature if s else 0.0, seed)
                for p, s, seed in zip(self.prompts, self.sampled, self.seeds)]

    def shard(self, answers: list[list[int]]) -> Shard:
        """The batch as a token-store shard, given each row's answer (its ids up to and including EOS)."""
        rows = [torch.cat([p, torch.tensor(a, dtype=torch.long)]) for p, a in zip(self.prompts, answers)]
        return Shard(rows, [len(p) for p in self.prompts], list(self.sampled),
                     {"categories": list(self.categories), "questions": list(self.questions)})


def plan_batch(model, cfg: DataConfig, index: int) -> BatchPlan:
    """Batch ``index``'s requests (deterministic in seed and index), from ``cfg.prompts``' mix
    (``specdec.tools.train.prompts``): the target first answers each row's meta-prompt (sampled, up to
    ``max_question_tokens``, one batch ``generate`` call), which becomes the request; the "written" mix's
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
    seeds = [rng.randrange(2**31) for _ in range(n)]
    return BatchPlan(prompts, sampled, seeds, [p.category for p in plans], questions)


def answer_stream(model, jobs: Iterable[tuple[torch.Tensor, float, int]],
                  max_new_tokens: int) -> Iterator[tuple[int, list[int]]]:
    """The target's answers to ``jobs`` — (prompt ids, temperature (0 = greedy), seed) each — through
    one running batch of ``model.batch_size`` rows (the ``Engine``'s add / step / release).

    A row whose answer ends (EOS, kept as its last id, or ``max_new_tokens``) is handed back and
    refilled with the next job before the next step (a single-row context encoding), so no row idles
    until the longest answer of its batch ends, as it does in one batch ``generate`` call: on the
    written requests 17-31% of a batch's row-steps were such idle rows. Yields (job index, answer ids)
    in the order the answers end. Each row draws from its own seeded generator, so an answer depends
    on its job only, not on the jobs beside it (exactly in f32; in bf16 a kernel of another KV bucket
    may round a near-tie the other way)."""
    from ...core.engine import Engine

    engine = Engine(model)
    pending = enumerate(jobs)
    owner: dict[int, int] = {}          # row -> job index
    while True:
        for row in [r for r in owner if engine.rows[r].done]:
            yield owner.pop(row), list(engine.rows[row].new)
            engine.release(row)
        for row in engine.free_rows:
            nxt = next(pending, None)
            if nxt is None:
                break
            i, (prompt, temperature, seed) = nxt
            owner[engine.add(prompt, row=row, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                             temperature=temperature if temperature > 0 else None, seed=seed)] = i
        if not owner:
            return
        if engine.active_rows:
            engine.step()


def generate_tokens(model, cfg: DataConfig, index: int) -> Shard:
    """One batch of requests + the target's answers, as token rows (deterministic in seed and index):
    a ``store.Shard`` whose meta holds the categories and the requests' text (``plan_batch``, then
    ``answer_stream``)."""
    plan = plan_batch(model, cfg, index)
    answers = dict(answer_stream(model, plan.jobs(cfg), cfg.max_new_tokens))
    return plan.shard([answers[i] for i in range(len(plan.prompts))])


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


def generate_shards(model, cfg: DataConfig, batches: list[int], store: Path, progress: bool = False) -> None:
    """The token-store shards of ``batches`` (``plan_batch`` for each, then all their rows through one
    ``answer_stream``), each written to ``store`` as soon as its last row's answer ends, so an
    interrupted run keeps every shard it finished. A shard's ``seconds`` is the wall time since the
    previous shard of the call was written (the first: since the call started, planning included)."""
    if not batches:
        return
    last = time.perf_counter()
    plans = {i: plan_batch(model, cfg, i) for i in batches}
    owners = [(i, j) for i in batches for j in range(len(plans[i].prompts))]
    answers: dict[int, dict[int, list[int]]] = {i: {} for i in batches}
    jobs = (job for i in batches for job in plans[i].jobs(cfg))
    bar = tqdm(total=len(owners), desc="answering", unit="row", leave=False, disable=not progress)
    for n, answer in answer_stream(model, jobs, cfg.max_new_tokens):
        i, j = owners[n]
        answers[i][j] = answer
        bar.update()
        if len(answers[i]) == len(plans[i].prompts):
            shard = plans[i].shard([answers[i][j] for j in range(len(answers[i]))])
            shard.meta.pop("questions")   # the prompts' text: decodable from their tokens
            now = time.perf_counter()
            shard.meta.update(model=model.path.name, settings=token_settings(cfg), refill=True,
                              answer_tokens=sum(len(a) for a in answers.pop(i).values()), seconds=round(now - last, 1))
            write_shard(store, cfg.seed, i, shard, model.vocab_size)
            last = now
    bar.close()


def generation_model(cfg: DataConfig, target_path=None, device: str = "cpu"):
    """The target as data generation runs it on ``device``: ``cfg.batch_size`` rows, room for
    ``max_prompt_tokens`` + ``max_new_tokens``, ``cfg``'s backend, amp and global top-k."""
    from ...core.decoder import DecoderModel
    from ...core.sampling import SamplingConfig

    prompt_room = max(256, cfg.max_prompt_tokens)
    n_pos = prompt_room + cfg.max_new_tokens
    return DecoderModel.from_pretrained(target_path, batch_size=cfg.batch_size, n_positions=n_pos, amp=cfg.amp,
                                        backend=cfg.backend, device=device, progress=False,
                                        context_buckets=sorted({64, 128, 256, prompt_room}),
                                        # KV buckets every 64 slots: at batch 128 a decode step reads
                                        # 23 KB of K/V per row and slot (1.5 GB at 512), more than the
                                        # weights, so a tight bucket matters (docs/training.md,
                                        # "Draft training data")
                                        kv_buckets=sorted({*range(128, n_pos, 64), n_pos}),
                                        sampling=SamplingConfig(global_topk=cfg.global_topk))


def kept_shard(store: Path, cfg: DataConfig, index: int) -> Shard:
    """Batch ``index``'s shard from ``store``; ValueError if it was generated with other settings."""
    shard_file = store / shard_name(cfg.seed, index)
    shard = read_shard(shard_file)
    if shard.meta.get("settings") != token_settings(cfg):
        raise ValueError(f"{shard_file} was generated with other settings ({shard.meta.get('settings')}); "
                         "use another store or the same settings")
    return shard


def generate_data(out_dir: str | Path, cfg: DataConfig, target_path=None, progress: bool = True,
                  store: str | Path | None = None, window: int = 8, label: bool = True,
                  device: str = "cpu") -> Path:
    """Generate (or finish generating) the dataset in ``out_dir``; returns it. Resumable.

    The batches not yet in ``out_dir`` go in windows of ``window`` batches: the window's batches that the
    token store ``store`` (default ``out_dir/tokens``; ``specdec.tools.train.store``) lacks are generated
    together (``generate_shards``: one running batch, finished rows refilled) and kept there as shards;
    then each batch of the window is read back from the store (its settings checked) and labelled by
    prefill (``labelled_batch``) into ``out_dir/batch_NNNNN.pt``. ``label=False``: only the store's shards
    are made (a trainer that needs no labels reads the store itself: ``store_rows``). ``device``: where the
    target runs (e.g. "cuda"; the tokens are the same kind of data, not the CPU's bits)."""
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
    done = (lambda i: (out_dir / f"batch_{i:05d}.pt").is_file()) if label else \
        (lambda i: (store / shard_name(cfg.seed, i)).is_file())
    todo = [i for i in range(n_batches) if not done(i)]
    if not todo:
        return out_dir
    model = generation_model(cfg, target_path, device)
    bar = tqdm(total=n_batches, initial=n_batches - len(todo), desc="generating data", unit="batch",
               disable=not progress)
    for w in range(0, len(todo), window):
        batches = todo[w:w + window]
        kept = {i: kept_shard(store, cfg, i) for i in batches if (store / shard_name(cfg.seed, i)).is_file()}
        missing = [i for i in batches if i not in kept]
        generate_shards(model, cfg, missing, store, progress)
        if not label:
            bar.update(len(batches))
            continue
        for i in batches:
            start = time.perf_counter()
            shard = kept[i] if i in kept else kept_shard(store, cfg, i)
            batch = labelled_batch(model, shard.tokens, shard.prompt_lens, shard.sampled)
            batch.update(categories=shard.meta.get("categories"), shard=shard_name(cfg.seed, i),
                         seconds=shard.meta.get("seconds", 0.0) * (i in missing) + time.perf_counter() - start)
            save_atomic(batch, out_dir / f"batch_{i:05d}.pt")
            bar.update()
            bar.set_postfix(tokens=sum(len(r) - p for r, p in zip(batch["tokens"], batch["prompt_lens"].tolist())),
                            s=f"{batch['seconds']:.0f}", agree=f"{batch['greedy_label_agreement']:.3f}")
    bar.close()
    return out_dir


def label_store(store: str | Path, out_dir: str | Path, target_path=None, progress: bool = True,
                amp: str = "bf16", batch_rows: int = 32, device: str = "cpu") -> Path:
    """Training data from kept tokens, by prefill only (the target on ``device``): every shard of the token
    store ``store`` (``specdec.tools.train.store``) labelled (``labelled_batch``) into ``out_dir/batch_<shard>.pt``,
    the ``load_dataset`` format. Resumable (labelled shards are skipped); returns ``out_dir``."""
    from ...core.decoder import DecoderModel
    from .store import shard_files

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = shard_files(store)
    if not files:
        raise ValueError(f"{store} holds no token shards (answers-s<seed>-<batch>.npz)")
    todo = [f for f in files if not (out_dir / label_name(f)).is_file()]
    if not todo:
        return out_dir
    shards = [(f, read_shard(f)) for f in todo]
    longest = max(len(t) for _, s in shards for t in s.tokens)
    model = DecoderModel.from_pretrained(target_path, batch_size=batch_rows, n_positions=max(longest, 2), amp=amp,
                                         backend="eager", device=device, progress=False)
    for f, shard in tqdm(shards, desc="labelling kept tokens", unit="shard", disable=not progress):
        batch = labelled_batch(model, shard.tokens, shard.prompt_lens, shard.sampled)
        batch.update(categories=shard.meta.get("categories"), shard=f.name)
        save_atomic(batch, out_dir / label_name(f))
    return out_dir


def label_name(shard_file: Path) -> str:
    """The labelled batch file of a store shard: answers-s<seed>-<batch>.npz → batch_s<seed>-<batch>.pt."""
    return f"batch_{shard_file.stem.removeprefix('answers-')}.pt"


def store_rows(store: str | Path) -> list[dict]:
    """A token store's rows without labels — tokens, prompt_len, sampled — in the order ``load_dataset``
    reads ``label_store``'s files of that store (so a features cache fits either): what a trainer needs
    when it chooses no vocabulary from labels (an EAGLE run starting from ``--init`` or resuming)."""
    from .store import read_store
    shards = sorted(read_store(store), key=lambda fs: label_name(fs[0]))
    return [{"tokens": t, "prompt_len": p, "sampled": s} for _, shard in shards
            for t, p, s in zip(shard.tokens, shard.prompt_lens, shard.sampled)]


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
