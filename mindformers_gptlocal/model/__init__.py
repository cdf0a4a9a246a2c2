"""The layer-sliced GPT-2 model."""
from .gpt import GPTLocalForCausalLM, GPTLocalModel
from .block import GPTLocalBlock
from .attention import ParallelAttention
from .feedforward import ParallelFeedForward

__all__ = ["GPTLocalForCausalLM", "GPTLocalModel", "GPTLocalBlock", "ParallelAttention", "ParallelFeedForward"]
