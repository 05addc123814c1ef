"""Default sampling parameters from a checkpoint's generation_config.json (vLLM's `--generation-config`).

vLLM reads the model's generation_config.json by default ('auto') and uses its sampling fields as the
defaults of requests that leave them unset (the request's own values always win):

    temperature, top_p, top_k, min_p, repetition_penalty   -> the same SamplingParams fields
    max_new_tokens                                          -> max_tokens

'vllm' ignores the file (neutral defaults); a folder reads that folder's generation_config.json.
`--override-generation-config '{"temperature": 0.6}'` is applied on top. Plain Python, no torch.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
RENAMED = {"max_new_tokens": "max_tokens"}


def default_sampling_params(mode: str, model_dir: str | None, overrides: dict[str, Any] | None = None
                            ) -> dict[str, Any]:
    """SamplingParams field -> default value, from generation_config.json per `mode` + overrides."""
    if mode not in ("auto", "vllm") and not os.path.isdir(mode):
        raise ValueError(f"--generation-config {mode!r} is neither 'auto', 'vllm' nor a folder")
    raw: dict[str, Any] = {}
    folder = model_dir if mode == "auto" else (mode if mode != "vllm" else None)
    if folder:
        path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    raw = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: cannot read ({e})") from None
        elif mode != "auto":
            raise ValueError(f"--generation-config {mode}: no generation_config.json in that folder")
    raw = {**raw, **(overrides or {})}
    out = {k: raw[k] for k in SAMPLING_FIELDS if raw.get(k) is not None}
    for src, dst in RENAMED.items():
        if raw.get(src) is not None:
            out[dst] = raw[src]
    if raw.get("do_sample") is False and "temperature" not in (overrides or {}):
        out["temperature"] = 0.0  # transformers' greedy decoding
    if out:
        log.info("default sampling parameters from the generation config: %s", out)
    return out
