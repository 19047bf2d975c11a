"""jaxserve: LLM inference and serving on JAX/XLA.

    from jaxserve import LLM, SamplingParams
    llm = LLM()                      # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))

The architecture is described in `jaxserve.engine`.
"""

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str):
    """Imported on first use, so that `jaxserve --help` does not wait for JAX."""
    if name == "LLM":
        from jaxserve.llm import LLM
        return LLM
    if name == "LoRARequest":
        from jaxserve.lora_request import LoRARequest
        return LoRARequest
    if name == "SamplingParams":
        from jaxserve.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
