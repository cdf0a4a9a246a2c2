"""Data preparation: tokenizers and the two dataset formats MindFormers reads."""
