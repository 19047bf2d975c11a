"""jaxserve: LLM inference and serving on JAX/XLA.

    from jaxserve import LLM, SamplingParams
    llm = LLM()                      # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))

The architecture is described in `jaxserve.engine`.
"""

from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
