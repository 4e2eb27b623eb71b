"""The strategies trained for the embedded SmolLM2-135M-Instruct, loaded one way.

    target = DecoderModel.from_pretrained()             # the embedded model
    draft = shipped("eagle", target)                    # or "draft", "medusa"
    SpeculativeGenerator(draft, target, k=5)

- ``"draft"``: the vanilla draft model (``specdec/draft/weights``: 2 layers, reduced output vocabulary;
  its embedding and LM-head rows come from the target, assembled once into ``$SPECDEC_CACHE``);
- ``"eagle"``: the EAGLE-1 head (``specdec/eagle/weights``; the LM head is copied from the target once);
- ``"eagle-tree"``: the same head drafting EAGLE-2 dynamic trees (``tree=DynamicTree(...)``);
- ``"eagle3"`` / ``"eagle3-tree"``: the EAGLE-3 head (``specdec/eagle/weights/smollm2-135m-instruct-eagle3``:
  three target layers' features, its own LM head over a reduced vocabulary; stored as int8 and expanded
  to bf16 once), as a chain or drafting dynamic trees;
- ``"medusa"``: the Medusa heads with the tree built from their measured accuracy
  (``specdec/medusa/weights``; ``tree=`` picks another).
Keyword arguments go to the strategy's ``from_pretrained``.
"""
from __future__ import annotations

from .core.decoder import DecoderModel
from .draft.proposer import DraftModel
from .draft.smollm2 import embedded_draft_path
from .eagle.proposer import EagleDraft
from .eagle.smollm2 import SHIPPED_EAGLE, SHIPPED_EAGLE3, embedded_eagle_path
from .eagle.tree import EagleTreeDraft
from .medusa.draft import MedusaDraft
from .medusa.smollm2 import SHIPPED_MEDUSA

SHIPPED = ("draft", "eagle", "eagle-tree", "eagle3", "eagle3-tree", "medusa")
TREE_KINDS = ("eagle-tree", "eagle3-tree")   # the EAGLE heads drafting EAGLE-2 dynamic trees


def shipped(kind: str, target: DecoderModel, **kwargs) -> DraftModel | EagleDraft | EagleTreeDraft | MedusaDraft:
    """The shipped ``kind`` strategy (one of ``SHIPPED``) for ``target`` (the embedded model)."""
    if kind == "draft":
        return DraftModel.from_pretrained(embedded_draft_path(), target, **kwargs)
    if kind in ("eagle", "eagle-tree", "eagle3", "eagle3-tree"):
        path = embedded_eagle_path(SHIPPED_EAGLE3 if kind.startswith("eagle3") else SHIPPED_EAGLE)
        return (EagleTreeDraft if kind in TREE_KINDS else EagleDraft).from_pretrained(path, target, **kwargs)
    if kind == "medusa":
        return MedusaDraft.from_pretrained(SHIPPED_MEDUSA, target, **kwargs)
    raise ValueError(f"no shipped strategy {kind!r}; choose one of {', '.join(SHIPPED)}")
