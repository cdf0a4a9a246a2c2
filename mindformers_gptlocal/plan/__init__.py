"""`gptlocal plan`: per-device memory and communication of a run YAML, arithmetic only (no MindSpore)."""
