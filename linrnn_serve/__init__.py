"""linrnn-serve: `from linrnn_serve import LLM, SamplingParams` (vLLM's offline API). Imported lazily,
so `import linrnn_serve.config` stays free of torch."""


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from linrnn_serve import llm

        return getattr(llm, name)
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from linrnn_serve import sampling_params

        return getattr(sampling_params, name)
    if name == "EngineArgs":
        from linrnn_serve.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'linrnn_serve' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineArgs", "RequestOutput", "CompletionOutput"]
