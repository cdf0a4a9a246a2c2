"""Checkpoints: crash-safe monitor + manifest, resume, per-rank split/merge, Hugging Face GPT-2 conversion."""
