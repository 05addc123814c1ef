"""LLMEngine: the engine's step loop. `add_request`, `step`, `abort`, `has_unfinished_requests`.

    step():  scheduler.schedule() -> executor.execute_async(plan) -> scheduler.postprocess(plan, result)
             -> one cumulative RequestOutput per request with new tokens (finished ones included)

Overlapped steps (`async_scheduling`, vLLM's async scheduling; on for CUDA by default): step() schedules
and launches step N+1, then waits for step N's sampled ids (a CUDA event on their pinned copy) and
postprocesses them, so the host's work of one step runs while the GPU computes the next. The scheduler
counts each sequence's sampled-but-unseen token (Sequence.num_inflight); a decode row whose last token
is still on the device is fed from it there (ModelRunner.slot_ids). A stop (EOS, stop string) found in
step N's tokens finishes the sequence one step late: the token step N+1 sampled for it is dropped and
its slot and blocks are reused only by work queued after step N+1 on the same stream. Steps whose
sampling needs the previous token on the host (multi-token bad words) and `capture_logits`
run synchronously. Grammar-constrained steps overlap too, as in vLLM: step N+1's grammar callback runs
once its forward is queued, waits there for step N's sampled ids (already copied by then: step N's
sampling precedes step N+1's forward on the stream), feeds them to the matchers and fills the masks
while the GPU computes. Greedy and seeded outputs are the same either way.

Construction: resolve the model (presets or a checkpoint directory) -> tokenizer -> the Executor
(engine/executor.py) builds its workers (runner/worker.py: load weights, pick the f32/bf16 state
heads, size the caches with a profile run on GPU, allocate pools, capture CUDA graphs) -> the
scheduler's slot / block allocators sized from the executor's budget. Not thread-safe: AsyncLLMEngine drives it
from one thread.
"""
from __future__ import annotations

import logging
import os
import random
import time
import dataclasses
from dataclasses import asdict, dataclass

import torch

from linrnn_serve.cache import BlockAllocator, PrefixCache, SlotAllocator
from linrnn_serve.cache.budget import CacheBudget
from linrnn_serve.config import EngineConfig, ModelConfig, default_max_num_batched_tokens
from linrnn_serve.engine_args import EngineArgs
from linrnn_serve.engine.executor import Executor
from linrnn_serve.engine.metrics import EngineMetrics
from linrnn_serve.engine.burst import IMMINENT_STEPS, MAX_HOLD_S, BurstHold
from linrnn_serve.engine.step_clock import StepClock
from linrnn_serve.engine.errors import EngineFullError, RequestError
from linrnn_serve.engine.outputs import CompletionOutput, RequestOutput
from linrnn_serve.engine.structured_output import StructuredOutputs
from linrnn_serve.engine import warmup
from linrnn_serve.engine.tokenizer import Tokenizer
from linrnn_serve.engine.validation import RequestLimits, validate_request
from linrnn_serve.generation_config import default_sampling_params
from linrnn_serve.models.loading import check_weights_fit, resolve_device, resolve_dtype
from linrnn_serve.sampling_params import SamplingParams
from linrnn_serve.runner.plan import StepPlan
from linrnn_serve.runner.prefill_graphs import prefill_buckets
from linrnn_serve.scheduler import Request, Scheduler, SchedulerConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192
ALLOW_LONG_ENV = "LINRNN_ALLOW_LONG_MAX_MODEL_LEN"  # vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN works too


@dataclass
class ResolvedModel:
    cfg: ModelConfig
    model_dir: str | None
    tokenizer_dir: str | None
    name: str


def resolve_model(name_or_path: str, load_format: str) -> ResolvedModel:
    """Preset names / checkpoint directories -> config + directories (presets.py when present)."""
    try:
        from linrnn_serve import presets
    except ImportError:
        presets = None
    is_dir = os.path.isfile(os.path.join(name_or_path, "config.json"))
    if presets is not None and hasattr(presets, "resolve_model"):
        try:
            r = presets.resolve_model(name_or_path, load_format)
            return ResolvedModel(r.cfg, getattr(r, "model_dir", None), getattr(r, "tokenizer_dir", None),
                                 getattr(r, "name", name_or_path))
        except ValueError as e:
            if not is_dir:
                raise
            # e.g. no tokenizer files and no fallback tokenizer fits this vocab: serve token ids only
            log.warning("%s: %s; loading the checkpoint without a tokenizer", name_or_path, e)
    if not os.path.isdir(name_or_path):
        raise ValueError(f"model {name_or_path!r} is not a checkpoint directory (and linrnn_serve.presets is not "
                         f"available to resolve names)")
    cfg = ModelConfig.from_pretrained(name_or_path)
    return ResolvedModel(cfg, name_or_path, name_or_path, os.path.basename(os.path.normpath(name_or_path)))


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        t_start = time.perf_counter()
        self.device = resolve_device(config.device)
        if config.max_num_batched_tokens is None:
            total = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
            config = dataclasses.replace(config, max_num_batched_tokens=max(
                default_max_num_batched_tokens(self.device.type, total), config.max_num_seqs))
        self.config = config
        self._validate_config(config)
        resolved = resolve_model(config.model, config.load_format)
        self.model_config = cfg = resolved.cfg
        self.model_name = config.served_model_name or resolved.name
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.max_model_len = config.max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > cfg.max_position_embeddings:
            allowed = config.allow_long_max_model_len or os.environ.get(
                ALLOW_LONG_ENV, os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0")) in ("1", "true")
            if not allowed:
                raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's limit "
                                 f"(max_position_embeddings {cfg.max_position_embeddings}): lower --max-model-len, or "
                                 f"pass --allow-long-max-model-len (or set {ALLOW_LONG_ENV}=1) to run positions the "
                                 f"model was not trained on")
            log.warning("max_model_len %d exceeds the model's max_position_embeddings %d (allowed by "
                        "--allow-long-max-model-len / %s)", self.max_model_len, cfg.max_position_embeddings,
                        ALLOW_LONG_ENV)
        self.default_sampling_params = default_sampling_params(
            config.generation_config, resolved.model_dir, config.override_generation_config)
        self.tokenizer = self._load_tokenizer(resolved)

        # refuse a model that cannot fit before minutes of building it
        check_weights_fit(cfg, self.dtype, self.device, self.model_name, config.gpu_memory_utilization,
                          shards=config.tensor_parallel_size)
        calib = None
        if config.ssm_calibration:
            if self.tokenizer is None:
                raise ValueError("ssm_calibration needs a tokenizer to encode the calibration text")
            with open(config.ssm_calibration, encoding="utf-8") as f:
                calib = self.tokenizer.encode(f.read())
        self.executor = Executor.create(config, cfg, resolved.model_dir, self.device, self.dtype, self.max_model_len,
                                        calibration_tokens=calib, progress=progress)
        self.budget: CacheBudget = self.executor.budget
        a = config.async_scheduling
        self.async_scheduling = (self.device.type == "cuda" if a is None else bool(a)) and \
            self.executor.supports_async
        # the engine-core process waits for arrivals until bind_deadline() before scheduling the next step
        self.late_binding = self.async_scheduling and config.late_binding is not False
        self._inflight = None  # (plan, pending step) launched and not yet postprocessed
        self._host_token_reqs: set[str] = set()  # requests whose sampling reads their previous tokens on the host
        self._accepted = None  # the last step whose sampled tokens went to the grammar matchers
        self.clock = StepClock()  # launched steps' device time: late binding (bind_deadline)
        # burst coalescing (engine/burst.py): set by the engine-core process; None: admit whatever waits
        self.burst: BurstHold | None = None
        self.burst_head_start = False  # (with burst) a held burst's first arrivals start prefilling early
        self._parked: frozenset[str] = frozenset()  # requests of a head start: no decode until the burst is in
        self._parked_limit = 0.0  # the longest they wait for the rest (their oldest arrival + MAX_HOLD_S)
        self._first_waiting_at = 0.0  # when the oldest waiting request reached this engine (head start)
        self._prefill_buckets = prefill_buckets(config.max_num_batched_tokens)

        eos = list(self.tokenizer.eos_token_ids) if self.tokenizer else []
        eos += [e for e in cfg.eos_token_id if e not in eos]
        self.eos_token_ids = eos
        blocks = BlockAllocator(self.budget.num_kv_blocks)
        self.prefix_cache = PrefixCache(blocks, SlotAllocator(self.budget.num_snapshots), config.block_size,
                                        layout_key=self.executor.describe().get("state_layout")) \
            if config.enable_prefix_caching else None
        self.structured = StructuredOutputs(self.tokenizer, cfg.vocab_size, eos)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                            config.block_size),
            SlotAllocator(self.budget.num_state_slots), blocks, eos,
            self._detokenizer if self.tokenizer else None,
            prefix_cache=self.prefix_cache)
        # False in the engine-core process: the client detokenizes, the core only where stop strings need text
        self.detokenize_all = True
        self._rng = random.Random(config.seed)
        self.metrics = EngineMetrics()
        self._finished_aborts: list[RequestOutput] = []
        self.num_steps = 0
        self.last_plan = None  # the latest step's StepPlan (timing breakdowns)
        self.capture_logits = False  # tests: keep a copy of every step's logits per (request, sample, position)
        self.logits_log: dict[tuple[str, int, int], torch.Tensor] = {}

        if warmup.enabled(self.device):
            warmup.warm_up(self)
        d = self.executor.describe()
        log.info("model %s (%s, %d layers: %d GDN + %d attention; %d experts top-%d), %s on %s, weights %.2f GiB "
                 "loaded in %.1f s", self.model_name, cfg.model_type, cfg.num_hidden_layers, len(cfg.gdn_layers),
                 len(cfg.attn_layers), cfg.num_experts, cfg.num_experts_per_tok, str(self.dtype).replace("torch.", ""),
                 self.device, d["weight_bytes"] / 2**30, d["weights_seconds"])
        f32 = d["state_f32_fraction"]
        log.info("recurrent state: %s; f32 heads %.1f%% / bf16 %.1f%%; %.2f MiB per sequence",
                 d["head_map"], 100 * f32, 100 * (1 - f32), d["state_bytes_per_seq"] / 2**20)
        log.info("caches: %s", self.budget.describe())
        log.info("max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, overlapped steps %s (late binding "
                 "%s), mixed batches %s, CUDA graphs %s; engine ready in %.1f s", self.max_model_len,
                 config.max_num_seqs, config.max_num_batched_tokens, "on" if self.async_scheduling else "off",
                 "on" if self.late_binding else "off",
                 "on" if d.get("mixed_batch") else "off",
                 f"on ({d['num_graphs']} captured in {d['graph_capture_seconds']:.1f} s, "
                 f"{d['graph_capture_bytes'] / 2**30:.2f} GiB)" if d["cuda_graphs"] else "off",
                 time.perf_counter() - t_start)

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams):
        if self.detokenize_all or params.stop:
            return self.tokenizer.detokenizer(prompt_ids, params)
        return None

    # in-process worker internals, for tests and benchmarks only (UniProcExecutor)
    @property
    def runner(self):
        return self.executor.worker.runner

    @property
    def model(self):
        return self.executor.worker.model

    @property
    def caches(self):
        return self.executor.worker.caches

    @property
    def head_map_description(self) -> str:
        return self.executor.describe()["head_map"]

    @classmethod
    def from_engine_args(cls, model: str, progress: bool = True, **kwargs) -> "LLMEngine":
        return cls(EngineArgs(model=model, **kwargs).create_engine_config(), progress=progress)

    # ---- setup helpers ---------------------------------------------------------------------
    @staticmethod
    def _validate_config(c: EngineConfig) -> None:
        def bad(msg):
            raise ValueError(msg)

        if c.max_num_seqs < 1:
            bad(f"max_num_seqs must be >= 1, got {c.max_num_seqs}")
        if c.max_num_batched_tokens < c.max_num_seqs:
            bad(f"max_num_batched_tokens ({c.max_num_batched_tokens}) must be >= max_num_seqs ({c.max_num_seqs})")
        if c.block_size < 1:
            bad(f"block_size must be >= 1, got {c.block_size}")
        if c.max_model_len is not None and c.max_model_len < 2:
            bad(f"max_model_len must be >= 2, got {c.max_model_len}")
        if c.max_queue_len < 1:
            bad(f"max_queue_len must be >= 1, got {c.max_queue_len}")
        if c.enable_prefix_caching and c.num_prefix_snapshots is None and not 0.0 < c.prefix_snapshot_fraction < 1.0:
            bad(f"prefix_snapshot_fraction must be in (0, 1), got {c.prefix_snapshot_fraction}")
        if c.num_prefix_snapshots is not None and c.num_prefix_snapshots < 1:
            bad(f"num_prefix_snapshots must be >= 1, got {c.num_prefix_snapshots}")

    def _load_tokenizer(self, resolved: ResolvedModel) -> Tokenizer | None:
        d = resolved.tokenizer_dir
        if d and os.path.isfile(os.path.join(d, "tokenizer.json")):
            return Tokenizer.from_dir(d, resolved.cfg.eos_token_id)
        log.warning("no tokenizer.json for %s: prompts must be token ids and outputs carry no text", resolved.name)
        return None

    # ---- requests ----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(text or None, prompt ids); the ids are checked by validate_request."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: give the prompt as token ids", "prompt")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.model_config.vocab_size, self.max_model_len, self.config.max_num_seqs,
                             self.scheduler.kv_capacity_tokens, self.config.max_logprobs)

    def validate_request(self, ids: list[int], params: SamplingParams) -> list[int]:
        """engine/validation.py against this engine's limits, tokenizer and grammar compiler: the ids to run."""
        return validate_request(ids, params, self.limits, self.tokenizer, self.structured)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, prompt_token_ids: list[int] | None = None) -> Request:
        """Queue a request. Raises RequestError (and its kinds: SamplingParamError, StructuredOutputError,
        PromptTooLongError) for a bad request, EngineFullError when the waiting queue is full."""
        params = params if params is not None else SamplingParams()
        if prompt_token_ids is not None:
            text, ids = (prompt if isinstance(prompt, str) else None), list(prompt_token_ids)
        else:
            text, ids = self.tokenize_prompt(prompt)
        return self.add_validated_request(request_id, text, self.validate_request(ids, params), params, arrival_time)

    def add_validated_request(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                              arrival_time: float | None = None) -> Request:
        """Queue a request whose ids and params came out of validate_request."""
        if request_id in self.scheduler.requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        if self.scheduler.num_waiting_requests >= self.config.max_queue_len:
            raise EngineFullError(f"the waiting queue is full ({self.config.max_queue_len} requests); retry later")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, ids, params, seed, prompt=text, arrival_time=arrival_time)
        first = not self.scheduler.waiting
        self.scheduler.add_request(req)
        if self.burst is not None:
            now = time.monotonic()
            if first:
                self._first_waiting_at = now  # (the core's clock: arrival_time is the client's)
            self.burst.arrived(now)
        if self.structured.needs(params):
            self.structured.add([s.seq_id for s in req.seqs], params)
        if self._needs_host_tokens(params):
            self._host_token_reqs.add(request_id)
        return req

    def _needs_host_tokens(self, p: SamplingParams) -> bool:
        """Sampling that reads the sequence's previous tokens on the host (multi-token bad words): such steps
        are not overlapped. Penalties are not: their statistics live on the device (sampler.PenaltyState)."""
        return any(len(w) > 1 for w in p.bad_words_token_ids or ())

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request; returns its final output (finish_reason 'abort'), None if unknown/finished."""
        req = self.abort_request(request_id)
        return None if req is None else self.output(req)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a request; returns it (finished, finish_reason 'abort'), None if unknown/finished."""
        req = self.scheduler.abort_request(request_id)
        if req is not None:
            self._host_token_reqs.discard(request_id)
            for s in req.seqs:
                self.structured.remove(s.seq_id)
            self._observe_finish(req, time.monotonic())
        return req

    def check_health(self) -> None:
        """Raise if a worker is gone (tensor-parallel worker processes; in-process workers cannot be)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Release the workers (stops tensor-parallel worker processes)."""
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; a cumulative RequestOutput per request with new output."""
        return [self.output(req) for req in self.step_requests()]

    def step_requests(self) -> list[Request]:
        """One engine step; the requests with new output (finished ones included). Overlapped: launch the
        next step, then postprocess the one in flight."""
        sync = not self.async_scheduling or self.capture_logits or bool(self._host_token_reqs)
        if sync and self._inflight is not None:  # the next schedule needs the in-flight tokens on the host
            return self._complete(self._take_inflight())
        t_schedule = time.monotonic()
        plan = self.last_plan = self.scheduler.schedule() if self.burst is None else self._schedule_burst(t_schedule)
        done = self._take_inflight()
        if plan.empty and plan.snapshot_saves_before:  # finished sequences' prefix-cache snapshots: taken
            self.executor.execute_async(plan)          # before the slots are reused (stream-ordered)
        if not plan.empty:
            constrained = self.structured.constraints
            if constrained and (any(r.sampling.seq_id in constrained for r in plan.decode) or any(
                    s.seq_id in constrained for r in plan.prefill for s in r.samples)):
                plan.fill_bitmask = self._grammar_fill(done)
            self._inflight = (plan, self.executor.execute_async(plan))
            self.clock.launched(len(plan.decode), sum(len(r.token_ids) for r in plan.prefill), t_schedule,
                                time.monotonic(), len(plan.prefill))
            if sync:
                return self._complete(self._take_inflight())
        return self._complete(done) if done is not None else []

    def _grammar_fill(self, inflight):
        """The step's bitmask callback (the runner calls it once the forward is queued): the tokens of the
        step still in flight, if any, reach the matchers first (its result waits for its ids' copy)."""
        def fill(host, seq_ids):
            if inflight is not None:
                self._accept_sampled(inflight[1])
            self.structured.fill(host, seq_ids)
        return fill

    def _accept_sampled(self, pending) -> None:
        """Queue a step's sampled tokens for the grammar matchers, once per step."""
        if pending is self._accepted or not self.structured.constraints:
            return
        self._accepted = pending
        for sid, tok in pending.result().sampled.items():
            self.structured.accept(sid, tok)

    def _take_inflight(self):
        x, self._inflight = self._inflight, None
        return x

    def drain(self) -> list[Request]:
        """Postprocess the step in flight, if any (overlapped steps); the requests with new output."""
        x = self._take_inflight()
        return self._complete(x) if x is not None else []

    def bind_deadline(self) -> float | None:
        """Late binding (engine/step_clock.py): the time.monotonic() until which the next step's scheduling
        may wait for arrivals, while the step in flight runs; None: schedule now (nothing in flight, steps
        not overlapped, late binding off, or no prediction yet)."""
        if self._inflight is None or not self.late_binding:
            return None
        s = self.scheduler
        return self.clock.deadline(min(s.num_waiting_seqs, max(self.config.max_num_seqs - s.num_running_seqs, 0)))

    def _hold(self, now: float) -> float | None:
        """Until when burst coalescing holds the waiting requests' admission (engine/burst.py); None: admit."""
        s = self.scheduler
        if not s.waiting:
            return None
        return self.burst.until(now, s.oldest_waiting_arrival, len(s.waiting),
                                lambda: 0 if self._parked else s.num_finishing_within(IMMINENT_STEPS))

    def _burst_hold(self, now: float) -> tuple[float | None, int | None]:
        """(until when admission is held or None, the prompt tokens of a head start to admit now or None)."""
        s = self.scheduler
        hold = self._hold(now)
        if hold is None and self._parked and not s.waiting and now < self._parked_limit and self.burst.owed(now):
            hold = self._parked_limit  # the head start took every arrival so far: the burst's rest is on its way
        if hold is None or self._parked or s.running or not self.burst_head_start:
            return hold, None
        return hold, self.burst.head_start(now, self._first_waiting_at, [len(q.token_ids) for q in s.waiting],
                                           self._prefill_buckets)

    def _schedule_burst(self, now: float) -> StepPlan:
        """The next plan under burst coalescing: admission held, a head start (its requests parked), or the
        burst's release (the head start stays parked one step more, while the rest prefills)."""
        s, parked = self.scheduler, self._parked
        hold, head = self._burst_hold(now)
        if hold is None:
            if not parked:
                return s.schedule()
            self._parked = frozenset()
            return s.schedule(parked=parked if s.waiting else frozenset())
        if head is None:
            return s.schedule(admit=False, parked=parked)
        self.burst.head_starts += 1
        plan = s.schedule(admit_tokens=head)
        self._parked = frozenset(q.group.request_id for q in s.running)
        self._parked_limit = min(q.group.arrival_time for q in s.running) + MAX_HOLD_S
        return plan

    def idle_hold_until(self) -> float | None:
        """With nothing to run but waiting requests that burst coalescing holds back (and a parked head start):
        until when (a time.monotonic(); the engine-core process waits for arrivals meanwhile); None otherwise."""
        if self.burst is None or self._inflight is not None or (self.scheduler.running and not self._parked):
            return None
        hold, head = self._burst_hold(time.monotonic())
        return None if head is not None else hold

    def inflight_done(self) -> bool:
        """Whether the step in flight has finished (its sampled ids are on the host); True if none."""
        if self._inflight is None:
            return True
        if self._inflight[1].done():
            self.clock.seen_done(time.monotonic())
            return True
        return False

    def _complete(self, launched) -> list[Request]:
        plan, pending = launched
        blocked = not pending.done()
        result = pending.result()
        self.clock.completed(time.monotonic() if blocked else None)
        if self.capture_logits:
            self._log_logits()
        now = time.monotonic()
        constrained = self.structured.constraints
        self._accept_sampled(pending)
        reqs = self.scheduler.postprocess(plan, result, now)
        self.num_steps += 1
        ended = 0
        for req in reqs:
            if req.finished_time is not None:  # (Request.finished, without its pass over the samples)
                ended += not req.aborted
                self._observe_finish(req, now)
                self._host_token_reqs.discard(req.request_id)
                if constrained:
                    for s in req.seqs:
                        self.structured.remove(s.seq_id)
        if ended and self.burst is not None:
            self.burst.finished(ended, now)
        return reqs

    def _observe_finish(self, req: Request, now: float) -> None:
        m = self.metrics
        with m.lock:
            if req.first_token_time is not None:
                m.ttft.observe(req.first_token_time - req.arrival_time)
            m.e2e.observe(now - req.arrival_time)
            for s in req.seqs:
                m.requests_finished[s.finish_reason] = m.requests_finished.get(s.finish_reason, 0) + 1
                if s.num_output > 1 and s.first_token_time is not None:
                    m.itl.observe((s.last_token_time - s.first_token_time) / (s.num_output - 1))

    def _log_logits(self) -> None:
        """Before postprocess: key each sampled row by (request, sample, output position it decides)."""
        for sid, row in self.executor.worker.last_logits().items():
            seq = self.scheduler.seqs.get(sid)
            if seq is not None:
                self.logits_log[(seq.group.request_id, seq.index, seq.num_output)] = row.detach().cpu().clone()

    def output(self, req: Request) -> RequestOutput:
        """The request's cumulative output (all tokens so far: O(its length), build it only when needed)."""
        outs = [CompletionOutput(
            index=s.index, text=s.visible_text(), token_ids=s.output_token_ids,
            logprobs=list(s.logprobs) if s.logprobs is not None else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in req.seqs]
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                   "finished_time": req.finished_time, "num_prefill_tokens": req.num_prefill_tokens}
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                             prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
                             metrics=metrics, num_cached_tokens=req.num_cached_tokens)

    def drain_snapshot_saves(self) -> None:
        """Take the finish snapshots still pending (they normally ride on the next step)."""
        if self.prefix_cache is not None and not self.has_unfinished_requests():
            self.step_requests()

    def reset_stats(self) -> None:
        """Counters and histograms back to zero (after the start-up warm-up)."""
        self.scheduler.stats = type(self.scheduler.stats)()
        if self.prefix_cache is not None:
            self.prefix_cache.stats = type(self.prefix_cache.stats)()
        self.metrics = EngineMetrics()
        self.num_steps = 0

    # ---- introspection -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Idle-time check: with no request in flight, every state slot and KV block is free."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("check_integrity() needs an idle engine")
        self.drain()  # a step in flight may still hold (finished) sequences' rows
        self.scheduler.check_idle_integrity()

    def stats(self) -> dict:
        s, sch = self.scheduler, self.scheduler.stats
        cache_only = self.prefix_cache.cache_only_blocks() if self.prefix_cache else 0
        m = self.metrics
        with m.lock:
            hist = {"time_to_first_token_seconds": m.ttft.snapshot(),
                    "inter_token_latency_seconds": m.itl.snapshot(),
                    "e2e_request_latency_seconds": m.e2e.snapshot()}
            finished = dict(m.requests_finished)
        return {
            "num_requests_running": len({q.group.request_id for q in s.running}),
            "num_requests_waiting": s.num_waiting_requests,
            "num_seqs_running": s.num_running_seqs,
            "num_seqs_waiting": s.num_waiting_seqs,
            # blocks only the prefix cache holds are evictable: free for this gauge, as vLLM counts them
            "kv_cache_usage": (s.blocks.num_used - cache_only) / max(s.blocks.capacity, 1),
            "prefix_cache_blocks": cache_only,
            "state_cache_usage": s.slots.num_used / max(s.slots.capacity, 1),
            "num_preemptions_total": sch.num_preemptions,
            "prompt_tokens_total": sch.prompt_tokens,
            "generation_tokens_total": sch.generation_tokens,
            "recomputed_tokens_total": sch.recomputed_tokens,
            "prefill_tokens_total": sch.prefill_tokens,
            # vLLM's names: prompt tokens looked up in / served from the prefix cache
            "prefix_cache_queries_total": sch.prefix_cache_queries,
            "prefix_cache_hits_total": sch.prefix_cache_hits,
            "prefix_cache_snapshots": self.prefix_cache.num_snapshots if self.prefix_cache else 0,
            "request_success_total": finished,
            "num_steps_total": self.num_steps,
            **hist,
        }

    def describe(self) -> dict:
        d = self.executor.describe()
        return {"model": self.model_name, "dtype": str(self.dtype), "device": str(self.device),
                "max_model_len": self.max_model_len, "budget": asdict(self.budget),
                "state_f32_fraction": d["state_f32_fraction"], "cuda_graphs": d["cuda_graphs"],
                "async_scheduling": self.async_scheduling, "mixed_batch": bool(d.get("mixed_batch"))}
