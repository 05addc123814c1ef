"""Device inputs, CUDA-graph capture/replay per batch bucket, and sampling.

    plan.py          StepPlan / StepResult: the scheduler <-> runner hand-off (plain data)
    inputs.py        ForwardBatch from per-sequence work (prefill, Session)
    model_runner.py  ModelRunner.execute(plan): static decode buffers, graphs, prefill, sampling
    cuda_graphs.py   decode buckets and graph capture
    sampler.py       greedy / temperature / top-k / top-p / min-p / seeded; penalties; logprobs
    session.py       drive a few sequences directly (tests, perplexity, KL gate)
"""
