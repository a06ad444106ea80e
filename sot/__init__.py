"""SoT (State over Tokens): lossless tree-speculative decoding for causal language models."""
from sot.api import Completion, Score, SoT, StreamEvent
from sot.drafters import DrafterKind, TreeBudget
from sot.engine import Engine, GenerationParams
from sot.errors import SoTError
from sot.sampling import SamplingMode, SamplingParams

__all__ = [
    "Completion",
    "DrafterKind",
    "Engine",
    "GenerationParams",
    "SamplingMode",
    "SamplingParams",
    "Score",
    "SoT",
    "SoTError",
    "StreamEvent",
    "TreeBudget",
]
__version__ = "0.1.0"
