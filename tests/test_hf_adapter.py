"""HFAdapter: transformers' generate() driving a DecoderModel (eager backend, tiny random Llamas)."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import DecoderModel
from specdec.core.hf_adapter import HFAdapter, StaticCacheView, as_hf

VOCAB = 128


def tiny_llama(seed: int, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tiny_llama(0)
    # a "close" draft: the target's weights plus noise, so candidates are often but not always right
    close = tiny_llama(1)
    with torch.no_grad():
        for p_draft, p_target in zip(close.parameters(), target.parameters()):
            p_draft.copy_(p_target + 0.1 * p_target.std() * torch.randn_like(p_target))
    unrelated = tiny_llama(2, layers=1)
    out = {}
    for name, hf in (("target", target), ("close", close), ("unrelated", unrelated)):
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        dm = DecoderModel.from_pretrained(path, batch_size=2, n_positions=256, backend="eager", progress=False)
        out[name] = (hf, HFAdapter(dm))
    return out


def left_padded(rows: list[list[int]]):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_adapter_is_a_transformers_model(models):
    hf, adapter = models["target"]
    assert adapter.can_generate() and adapter.config.vocab_size == VOCAB
    assert isinstance(as_hf(adapter.decoder), HFAdapter)
    with pytest.raises(TypeError):
        HFAdapter(hf)


@pytest.mark.parametrize("lengths", [[7], [5, 11]], ids=["batch1", "batch2-left-padded"])
def test_greedy_matches_hf(models, lengths):
    hf, adapter = models["target"]
    ids, mask = left_padded(prompts(3, lengths))
    ours = adapter.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False,
                            return_dict_in_generate=True, output_scores=True)
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False,
                      return_dict_in_generate=True, output_scores=True)
    assert ours.sequences.shape == ref.sequences.shape
    assert torch.equal(ours.sequences, ref.sequences)
    assert len(ours.scores) == len(ref.scores)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(ref.scores), atol=1e-4, rtol=1e-4)
    # plain decoding: one context encoding, then one 1-token step per new token
    assert adapter.decoder.lengths[: len(lengths)].tolist() == \
        [n + ours.sequences.shape[1] - ids.shape[1] - 1 for n in lengths]


def test_sampling_logits_match_hf(models):
    hf, adapter = models["target"]
    ids, mask = left_padded(prompts(4, [6, 9]))
    kwargs = dict(attention_mask=mask, do_sample=True, max_new_tokens=24, min_new_tokens=24, temperature=0.9,
                  top_k=20, return_dict_in_generate=True, output_scores=True, output_logits=True)
    torch.manual_seed(123)
    ours = adapter.generate(ids, **kwargs)
    torch.manual_seed(123)
    ref = hf.generate(ids, **kwargs)
    seq = ours.sequences
    assert seq.shape == (2, ids.shape[1] + 24)  # min_new_tokens == max_new_tokens: exactly 24
    new = seq[:, ids.shape[1]:]
    assert bool(((new >= 0) & (new < VOCAB)).all())
    # the raw logits the adapter returned at each step == the HF model's logits on the same sequence
    full_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
    with torch.no_grad():
        hf_logits = hf(seq, attention_mask=full_mask).logits[:, ids.shape[1] - 1: -1]
    torch.testing.assert_close(torch.stack(ours.logits, 1), hf_logits, atol=1e-4, rtol=1e-4)
    # same seed, same host-side sampling on (numerically) the same distributions → same tokens/scores
    assert torch.equal(seq, ref.sequences)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(ref.scores), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("draft", ["close", "unrelated"])
def test_assisted_generation_equals_target_greedy(models, draft):
    hf, adapter = models["target"]
    _, assistant = models[draft]
    ids = torch.tensor([prompts(5, [8])[0]])
    ref = hf.generate(ids, max_new_tokens=64, do_sample=False)
    plain = adapter.generate(ids, max_new_tokens=64, do_sample=False)
    assert torch.equal(plain, ref)
    if draft == "close":  # 5 candidates per step, no early stop on low draft confidence
        assistant.generation_config.num_assistant_tokens = 5
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
    adapter.clear_cache()
    assistant.clear_cache()
    out = adapter.generate(ids, assistant_model=assistant, max_new_tokens=64, do_sample=False)
    assert torch.equal(out, ref)
    # the target verified several candidates per step and rolled back rejected ones
    assert max(adapter.stats.step_widths) > 1
    assert adapter.stats.rolled_back > 0
    assert assistant.stats.steps > 0
    if draft == "close":
        assert adapter.stats.steps < 64 / 2  # most candidates accepted


def test_second_call_has_no_stale_state(models):
    hf, adapter = models["target"]
    first_ids, first_mask = left_padded(prompts(6, [4, 10]))
    adapter.generate(first_ids, attention_mask=first_mask, max_new_tokens=20, do_sample=False)
    # a different batch (smaller, other prompt), the same prompt again (cache reuse), and a prompt
    # that shares a prefix with the previous call's sequence but then diverges
    second = torch.tensor([prompts(7, [9])[0]])
    again = first_ids[1:2]
    previous = adapter.generate(again, max_new_tokens=20, do_sample=False)
    diverging = previous[:, :14].clone()
    diverging[0, -1] = (diverging[0, -1] + 1) % VOCAB
    for ids in (second, again, diverging, second):
        ours = adapter.generate(ids, max_new_tokens=30, do_sample=False)
        assert torch.equal(ours, hf.generate(ids, max_new_tokens=30, do_sample=False))
    # the DecoderModel used directly in between (its cache now holds another prompt): the adapter
    # notices that the lengths moved and re-encodes instead of trusting its record
    adapter.decoder.generate(again, max_new_tokens=5)
    ours = adapter.generate(second, max_new_tokens=10, do_sample=False)
    assert torch.equal(ours, hf.generate(second, max_new_tokens=10, do_sample=False))


def test_step_buckets_and_two_adapters_on_one_decoder(models):
    hf, adapter = models["target"]
    padded = HFAdapter(adapter.decoder, step_buckets=[1, 4, 16, 256])  # steps padded with filler tokens
    p_ids, p_mask = left_padded(prompts(9, [6, 10]))
    q_ids, q_mask = left_padded(prompts(10, [6, 10]))  # same shapes: lengths end up identical
    for a, ids, mask in ((padded, p_ids, p_mask), (adapter, q_ids, q_mask), (padded, p_ids, p_mask)):
        ours = a.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        assert torch.equal(ours, hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False))
    _, assistant = models["unrelated"]
    ids = p_ids[1:]
    padded.clear_cache()
    ours = padded.generate(ids, assistant_model=assistant, max_new_tokens=30, do_sample=False)
    assert torch.equal(ours, hf.generate(ids, max_new_tokens=30, do_sample=False))
    assert max(padded.stats.step_widths) > 1 and padded.stats.prefills == 1


def test_forward_with_divergent_rows_matches_full_forward(models):
    """Rows needing different numbers of new tokens, and a row that diverges mid-sequence."""
    hf, adapter = models["target"]
    adapter.clear_cache()
    rows = prompts(8, [12, 7])
    cache = StaticCacheView(adapter)

    def check(rows, keep):
        ids, mask = left_padded(rows)
        out = adapter(ids, attention_mask=mask, logits_to_keep=keep, past_key_values=cache)
        with torch.no_grad():
            ref = hf(ids, attention_mask=mask).logits[:, -keep:]
        assert out.logits.shape == (2, keep, VOCAB)
        for r, row in enumerate(rows):  # columns left of a short row's first token are padding
            real = min(keep, len(row))
            torch.testing.assert_close(out.logits[r, keep - real:], ref[r, keep - real:], atol=1e-4, rtol=1e-4)
        assert out.past_key_values is cache and cache.get_seq_length() == ids.shape[1]

    check(rows, 1)                                       # context encoding
    rows = [rows[0] + [5, 6, 7], rows[1] + [9]]          # 3 new tokens vs 1
    check(rows, 3)
    rows = [rows[0] + [10], rows[1][:3] + [11, 12, 13]]  # row 1 diverges at index 3
    check(rows, 2)
    assert adapter.stats.rolled_back >= len(rows[1]) + 1 - 3 - 3
    rows = [rows[0] + [4] * 2, rows[1] + [4] * 12]       # a step wider than row 0's new tokens
    check(rows, 13)
    before = adapter.stats.rolled_back
    cache.crop(-5)                                       # HF-style crop of the last 5 columns
    assert cache.get_seq_length() == len(rows[1]) - 5
    assert adapter.stats.rolled_back == before + 2 * 5   # both rows' records lost 5 tokens
    fives = adapter.stats.step_widths[5]
    check(rows, 1)
    assert adapter.stats.step_widths[5] == fives + 1     # ... so the 5 cropped tokens were re-run
    assert adapter.stats.prefills == 1


def test_prompt_longer_than_largest_context_bucket(models):
    hf, adapter = models["target"]
    small = DecoderModel.from_pretrained(adapter.decoder.path, batch_size=1, n_positions=64, context_buckets=[8],
                                         backend="eager", progress=False)
    ids = torch.tensor([prompts(11, [13])[0]])  # context-encode 8 tokens, then a 5-token step
    ours = as_hf(small).generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(ours, hf.generate(ids, max_new_tokens=16, do_sample=False))


def test_errors(models):
    _, adapter = models["target"]
    with pytest.raises(ValueError, match="batch_size"):
        adapter(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="n_positions"):
        adapter.generate(torch.ones(1, 250, dtype=torch.long), max_new_tokens=10, do_sample=False)
    with pytest.raises(ValueError, match="vocabulary"):
        adapter(torch.tensor([[VOCAB]]))
