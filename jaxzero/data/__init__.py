"""Data for fine-tuning: tokenizers and the cached token store (usable from scripts too)."""
