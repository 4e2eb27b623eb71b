"""The strategies trained for the embedded SmolLM2-135M-Instruct, loaded one way.

    target = DecoderModel.from_pretrained()             # the embedded model
    draft = shipped("eagle", target)                    # or "model", "medusa", ...
    SpeculativeGenerator(draft, target, k=5)

``kind`` is a name of the strategy registry (``specdec.registry``) whose weights ship in the specdec-assets
distribution (``SHIPPED``; ``pip install -e ./assets``, folders of ``assets/specdec_assets/``):

- ``"model"``: the vanilla draft model (``draft/``: 2 layers, reduced output vocabulary;
  its embedding and LM-head rows come from the target, assembled once into ``$SPECDEC_CACHE``);
- ``"eagle"``: the EAGLE-1 head (``eagle/``; the LM head is copied from the target once);
- ``"eagle-tree"``: the same head drafting EAGLE-2 dynamic trees (``tree=DynamicTree(...)``);
- ``"eagle3"`` / ``"eagle3-tree"``: the EAGLE-3 head (``eagle/smollm2-135m-instruct-eagle3``:
  three target layers' features, its own LM head over a reduced vocabulary; stored as int8 and expanded
  to bf16 once), as a chain or drafting dynamic trees;
- ``"medusa"``: the Medusa heads with the tree built from their measured accuracy
  (``medusa/``; ``tree=`` picks another).
Keyword arguments go to ``Strategy.build`` (``tree=``, ``depth=``) and the strategy's ``from_pretrained``.
A renamed kind (``"draft"``, now ``"model"``) is refused with its new name.
"""
from __future__ import annotations

from .core.decoder import DecoderModel
from .registry import SHIPPED, strategy
from .speculation.proposer import BaseProposer


def shipped(kind: str, target: DecoderModel, **kwargs) -> BaseProposer:
    """The shipped ``kind`` strategy (one of ``SHIPPED``) for ``target`` (the embedded model)."""
    found = strategy(kind)
    if not found.shipped:
        raise ValueError(f"no shipped strategy {kind!r}; choose one of {', '.join(SHIPPED)}")
    return found.build(target, **kwargs)
