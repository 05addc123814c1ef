"""Prometheus metrics in the text exposition format (0.0.4), rendered without a client library.

The engine owns the numbers (the engine client's `stats()`, the core process's snapshot: scheduler
gauges, cache usage, token and preemption counters, TTFT / inter-token / end-to-end histograms); this
module renders that snapshot generically, so a series the engine adds later shows up without a server change:

    number, key ending in `_total`   -> counter          dict of numbers -> counter, one label per key
    other number                     -> gauge            {"buckets", "sum", "count"} -> histogram

Names follow vLLM's with the prefix `linrnn:` (`kv_cache_usage` is shown as `kv_cache_usage_perc`,
0-1, like vLLM's); beside them the same numbers are exported under vLLM's exact names (`vllm:`
prefix, same histograms; `VLLM` below) through prometheus_client, so vLLM dashboards work. The server adds what only it sees: requests refused with an HTTP error, by status.
The cache gauges double as the leak check of the tests: once every request has finished or been
aborted, `linrnn:kv_cache_usage_perc` and `linrnn:state_cache_usage_perc` must be 0.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "linrnn:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

RENAME = {"kv_cache_usage": "kv_cache_usage_perc", "state_cache_usage": "state_cache_usage_perc"}
LABEL = {"request_success_total": "finished_reason", "request_refused_total": "status"}
HELP = {
    "num_requests_running": "Requests with a sequence in the running batch.",
    "num_requests_waiting": "Requests waiting to be admitted (what --max-queue-len bounds).",
    "num_seqs_running": "Sequences (samples) in the running batch.",
    "num_seqs_waiting": "Sequences waiting (new or preempted).",
    "kv_cache_usage_perc": "Fraction of paged-KV blocks in use (0-1).",
    "state_cache_usage_perc": "Fraction of recurrent-state slots in use (0-1).",
    "num_preemptions_total": "Sequences preempted (recomputed later).",
    "prompt_tokens_total": "Prompt tokens of admitted requests.",
    "generation_tokens_total": "Generated tokens.",
    "recomputed_tokens_total": "Tokens prefilled again after a preemption.",
    "prefill_tokens_total": "Tokens run through prefill forwards (prompts, recomputes).",
    "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries).",
    "prefix_cache_hits_total": "Prompt tokens served by the prefix cache (vLLM's prefix_cache_hits).",
    "prefix_cache_snapshots": "Recurrent-state snapshots held by the prefix cache.",
    "prefix_cache_blocks": "KV blocks held only by the prefix cache (evictable; not in kv_cache_usage_perc).",
    "request_success_total": "Finished requests by finish reason.",
    "num_steps_total": "Engine steps run.",
    "time_to_first_token_seconds": "Time from request arrival to its first token.",
    "inter_token_latency_seconds": "Time between output tokens (per-sequence mean).",
    "e2e_request_latency_seconds": "Time from request arrival to its end.",
    "core_decode_steps_total": "Decode-only engine steps timed by the engine core.",
    "core_decode_rows_total": "Sequences in those steps (divide by the steps for the mean batch).",
    "core_decode_step_seconds_total": "Wall time of the engine core's loop over those steps.",
    "core_decode_step_seconds": "Wall time of one decode-only step of the engine core's loop (receive, schedule, "
                                "run, postprocess, send).",
    "core_full_decode_steps_total": "Decode-only engine steps at the full batch (max_num_seqs sequences).",
    "core_full_decode_step_seconds_total": "Wall time of the engine core's loop over those full-batch steps.",
    "core_full_decode_step_seconds": "Wall time of one full-batch decode-only step of the engine core's loop.",
    "core_bind_windows_total": "Late binding: engine-core loop iterations that waited for arrivals before "
                               "scheduling the next step.",
    "core_bind_window_seconds_total": "Late binding: time the engine core waited in those windows.",
    "core_bind_window_arrivals_total": "Late binding: requests queued during those windows (each one step sooner).",
    "core_burst_holds_total": "Burst coalescing: scheduling decisions that held new prompts back for the rest of "
                              "their burst.",
    "core_burst_idle_seconds_total": "Burst coalescing: time the engine core waited, with nothing else to run, for "
                                     "the rest of a burst of arrivals.",
    "core_burst_head_starts_total": "Burst coalescing: held bursts whose first arrivals started prefilling before "
                                    "the rest arrived.",
    "request_refused_total": "Requests refused with an HTTP error, by status.",
}


def _num(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    v = float(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return "NaN" if v != v else repr(v)


def _labels(labels: dict[str, Any]) -> str:
    if not labels:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def render_series(name: str, value: Any, base: dict[str, str]) -> list[str]:
    """One metric family from one stats entry; [] for values it does not know how to show."""
    name = RENAME.get(name, name)
    full = PREFIX + name
    head = [f"# HELP {full} {HELP.get(name, name.replace('_', ' '))}"]
    if _is_number(value):
        kind = "counter" if name.endswith("_total") else "gauge"
        return head + [f"# TYPE {full} {kind}", f"{full}{_labels(base)} {_num(value)}"]
    if isinstance(value, dict) and {"buckets", "sum", "count"} <= set(value):
        out = head + [f"# TYPE {full} histogram"]
        for le, cum in value["buckets"]:
            out.append(f"{full}_bucket{_labels({**base, 'le': _num(le)})} {_num(cum)}")
        out.append(f"{full}_sum{_labels(base)} {_num(value['sum'])}")
        out.append(f"{full}_count{_labels(base)} {_num(value['count'])}")
        return out
    if isinstance(value, dict) and all(_is_number(v) for v in value.values()):
        label = LABEL.get(name, "key")
        kind = "counter" if name.endswith("_total") else "gauge"
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return head + [f"# TYPE {full} {kind}"] + [f"{full}{_labels({**base, label: k})} {_num(v)}" for k, v in items]
    return []


# vLLM's names for the same numbers (`vllm:` prefix, same bucket bounds), so vLLM dashboards work:
# engine stats key -> (vLLM name, kind, help). Our inter-token histogram is a per-request mean, which
# is vLLM's time_per_output_token_seconds (its inter_token_latency_seconds pools every gap: not ours).
VLLM = {
    "num_requests_running": ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    "num_requests_waiting": ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    "num_preemptions_total": ("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine."),
    "prompt_tokens_total": ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
    "generation_tokens_total": ("vllm:generation_tokens", "counter", "Number of generation tokens processed."),
    "request_success_total": ("vllm:request_success", "counter", "Count of successfully processed requests."),
    "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds", "histogram",
                                    "Histogram of time to first token in seconds."),
    "inter_token_latency_seconds": ("vllm:time_per_output_token_seconds", "histogram",
                                    "Histogram of time per output token in seconds."),
    "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds", "histogram",
                                    "Histogram of e2e request latency in seconds."),
}


class _VllmCollector:
    """prometheus_client collector over the latest engine snapshot (set by ServerMetrics.render)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        for key, (name, kind, doc) in VLLM.items():
            v = self.stats.get(key)
            if v is None:
                continue
            if kind == "gauge" and _is_number(v):
                m = GaugeMetricFamily(name, doc, labels=["model_name"])
                m.add_metric([self.model_name], float(v))
            elif kind == "counter" and isinstance(v, dict):
                m = CounterMetricFamily(name, doc, labels=["model_name", "finished_reason"])
                for reason, c in sorted(v.items()):
                    m.add_metric([self.model_name, str(reason)], float(c))
            elif kind == "counter" and _is_number(v):
                m = CounterMetricFamily(name, doc, labels=["model_name"])
                m.add_metric([self.model_name], float(v))
            elif kind == "histogram" and isinstance(v, dict) and "buckets" in v:
                m = HistogramMetricFamily(name, doc, labels=["model_name"])
                m.add_metric([self.model_name], [(_num(le), float(c)) for le, c in v["buckets"]], float(v["sum"]))
            else:
                continue
            yield m


class ServerMetrics:
    """What /metrics shows beyond the engine's snapshot. Updated on the event loop thread only."""

    def __init__(self, model_name: str):
        self.labels = {"model_name": model_name}
        self.refused: dict[str, int] = defaultdict(int)  # HTTP status -> requests refused
        self._vllm = _VllmCollector(model_name)
        try:
            from prometheus_client import CollectorRegistry
        except ImportError:  # a declared dependency; a hand-assembled environment may still lack it
            log.warning("prometheus_client is not installed: /metrics shows the linrnn: series only")
            self._registry = None
        else:
            self._registry = CollectorRegistry(auto_describe=False)
            self._registry.register(self._vllm)

    def render(self, engine_stats: dict[str, Any] | None) -> str:
        lines: list[str] = []
        for name, value in (engine_stats or {}).items():
            lines += render_series(name, value, self.labels)
        lines += render_series("request_refused_total", dict(self.refused), self.labels)
        text = "\n".join(lines) + "\n"
        if self._registry is not None:
            from prometheus_client import generate_latest

            self._vllm.stats = engine_stats or {}
            text += generate_latest(self._registry).decode()
        return text
