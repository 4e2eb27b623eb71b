"""specdec: speculative decoding on static-shape LLM decoders."""
from .core.decoder import DecoderModel, RuntimeSettings, StepOutput
from .core.graphs import GraphKey
from .core.sampling import SamplingConfig

__all__ = ["DecoderModel", "GraphKey", "RuntimeSettings", "SamplingConfig", "StepOutput"]
__version__ = "0.1.0"
