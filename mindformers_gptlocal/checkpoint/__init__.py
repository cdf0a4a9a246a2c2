"""Checkpoints: the crash-safe saves' manifest (the monitor is ``mf/checkpoint_monitor.py``), resume, per-rank
split/merge, the converters (Hugging Face GPT-2, Llama, GPT-NeoX; MindFormers 1.x GPT-2), LoRA merge and export,
models by name from the local Hugging Face cache."""
