"""Text generation with an explicit per-layer KV cache, on every backend."""
from .generate import generate_ids, resolve_options

__all__ = ["generate_ids", "resolve_options"]
