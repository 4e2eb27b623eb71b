"""specdec: speculative decoding on static-shape LLM decoders.

    from specdec import DecoderModel, SpeculativeGenerator, shipped
    target = DecoderModel.from_pretrained()                       # the embedded SmolLM2-135M-Instruct
    gen = SpeculativeGenerator(shipped("eagle", target), target, k=5)
"""
from .core.decoder import DecoderModel
from .core.engine import Engine
from .core.sampling import SamplingConfig
from .core.stats import SpecStats
from .draft.proposer import DraftModel
from .eagle.proposer import EagleDraft
from .eagle.tree import DynamicTree, EagleTreeDraft
from .generator import SpeculativeGenerator
from .lookup.branch import LookupBranch
from .lookup.combined import LookupOrDraft
from .lookup.proposer import PromptLookup
from .medusa.draft import MedusaDraft
from .shipped import shipped
from .speculation.adaptive import AdaptiveK
from .speculation.gate import CostGate
from .speculation.proposer import BaseProposer, Proposal, Proposer

__all__ = ["AdaptiveK", "BaseProposer", "CostGate", "DecoderModel", "DraftModel", "DynamicTree", "EagleDraft",
           "EagleTreeDraft", "Engine", "LookupBranch", "LookupOrDraft", "MedusaDraft", "PromptLookup", "Proposal",
           "Proposer", "SamplingConfig", "SpecStats", "SpeculativeGenerator", "shipped"]
__version__ = "0.1.0"
