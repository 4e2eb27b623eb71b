"""An embedding table that is only looked up is the checkpoint file's own pages (``loading.map_embedding``): a
load neither reads nor copies it; a table a float LM head shares, or one in another dtype, is loaded as before."""
from pathlib import Path

import torch

from specdec import DecoderModel
from specdec.core.checkpoint import mapped_tensor


def mapping_of(t: torch.Tensor) -> str | None:
    """The file behind the memory mapping that holds ``t``'s first byte (None: anonymous memory)."""
    address = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        start, end = (int(a, 16) for a in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


def test_an_untied_table_is_the_checkpoint_file_mapped():
    # the embedded GGUF model's LM head is its own blocks (quantization="gguf"): the f32 table is only looked up
    model = DecoderModel.from_pretrained(batch_size=1, n_positions=64, amp="f32", quantization="gguf",
                                         backend="eager", progress=False)
    table = model.lm.model.embed_tokens.weight
    checkpoint = Path(model.path) / "model.safetensors"
    assert mapping_of(table) == str(checkpoint.resolve())
    assert torch.equal(table, mapped_tensor(model.path, "model.embed_tokens.weight"))
    ids = torch.tensor([[1, 2, 3, 4]])
    out = model.generate(ids, max_new_tokens=4)
    assert out.shape == (1, 8)


def test_a_table_a_float_head_shares_or_of_another_dtype_is_loaded():
    tied = DecoderModel.from_pretrained(batch_size=1, n_positions=64, amp="f32", backend="eager", progress=False)
    assert tied.lm.lm_head.weight is tied.lm.model.embed_tokens.weight
    assert mapping_of(tied.lm.model.embed_tokens.weight) is None
    cast = DecoderModel.from_pretrained(batch_size=1, n_positions=64, amp="bf16", quantization="gguf",
                                        backend="eager", progress=False)
    table = cast.lm.model.embed_tokens.weight
    assert table.dtype == torch.bfloat16 and mapping_of(table) is None
    assert torch.equal(table, mapped_tensor(cast.path, "model.embed_tokens.weight").to(torch.bfloat16))
