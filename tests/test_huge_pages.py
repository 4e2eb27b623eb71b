"""``move_to_huge_pages``: a module's large storages move into 2 MiB-aligned memory advised for huge pages,
with the same values, ties and views; small ones stay where they are."""
import pytest
import torch
from torch import nn

from specdec.core.huge_pages import HUGE_PAGE, huge_pages_available, move_to_huge_pages

pytestmark = pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages on this system")


def test_large_storages_move_and_keep_values_ties_and_views():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(16, 16))
    m[1].weight = m[0].weight                                  # tied: one parameter in two modules
    m.register_buffer("table", torch.randn(1024, 1024))
    m.register_buffer("left", m.table[:, :512])                # a view of another buffer
    x = torch.randn(2, 1024)
    expected, small = m[1](m[0](x)), m[2].weight.data_ptr()
    moved = move_to_huge_pages(m)
    assert moved == 2 * 1024 * 1024 * 4                        # the weight (once) and the table
    assert m[0].weight is m[1].weight and m[0].weight.data_ptr() % HUGE_PAGE == 0
    assert m.table.data_ptr() % HUGE_PAGE == 0 and m.left.data_ptr() == m.table.data_ptr()
    assert torch.equal(m.left, m.table[:, :512])
    assert m[2].weight.data_ptr() == small                     # 1 KiB: left alone
    assert torch.equal(m[1](m[0](x)), expected)
    m.table.add_(1)                                            # still one storage
    assert torch.equal(m.left, m.table[:, :512])


def test_a_loaded_model_streams_its_weights_from_huge_pages():
    from specdec import DecoderModel
    model = DecoderModel.from_pretrained(batch_size=1, n_positions=64, amp="f32", progress=False)
    big = [t for t in model.lm.state_dict().values() if t.untyped_storage().nbytes() >= HUGE_PAGE]
    assert big and all(t.untyped_storage().data_ptr() % HUGE_PAGE == 0 for t in big)


def test_embedding_tables_stay_unless_a_head_shares_them():
    torch.manual_seed(0)
    m = nn.ModuleDict({"embed": nn.Embedding(1024, 1024), "tied": nn.Embedding(1024, 1024),
                       "head": nn.Linear(1024, 1024, bias=False)})
    m["head"].weight = m["tied"].weight                         # a tied LM head streams the table every step
    looked_up, values = m["embed"].weight.data_ptr(), m["embed"].weight.clone()
    moved = move_to_huge_pages(m)
    assert moved == 1024 * 1024 * 4                             # the tied table only
    assert m["embed"].weight.data_ptr() == looked_up and torch.equal(m["embed"].weight, values)
    assert m["tied"].weight is m["head"].weight and m["tied"].weight.data_ptr() % HUGE_PAGE == 0
