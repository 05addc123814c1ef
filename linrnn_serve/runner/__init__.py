"""Device inputs, CUDA-graph capture/replay per batch bucket, and sampling.

    plan.py          StepPlan / StepResult: the scheduler <-> runner hand-off (plain data)
    inputs.py        ForwardBatch from per-sequence work (prefill, Session)
    model_runner.py  ModelRunner.execute(plan) / execute_async(plan) -> PendingStep: the persistent device
                     batch (per-slot tables, sampling params, last sampled ids), graphs, prefill, sampling
    cuda_graphs.py   decode buckets and graph capture
    sampler.py       greedy / temperature / top-k / top-p / min-p / seeded; penalties; logprobs
    session.py       drive a few sequences directly (tests, perplexity, KL gate)
"""
