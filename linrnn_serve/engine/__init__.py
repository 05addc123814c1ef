"""Step loop, async bridge (per-request queues), tokenizer ownership, abort. Knows no HTTP."""
