"""Offline tools that are not part of the runtime: the data recipe, tokenizer and training pipeline of
the embedded default model (issue #8). See tools/README.md."""
