"""The GPT example lives in the package (``ampkit/examples/gpt.py``) so a wheel install can run it; this module
keeps the ``examples.gpt:GPTTrainer`` import path of a source checkout working."""

from ampkit.examples.gpt import GPT, Block, GPTConfig, GPTTrainer, corpus_bytes, generate, unigram_entropy

__all__ = ["GPT", "Block", "GPTConfig", "GPTTrainer", "corpus_bytes", "generate", "unigram_entropy"]
