"""`LLM`: the offline API. Give it prompts, get completions; batching happens inside."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxserve.config import EngineConfig
from jaxserve.engine.beam_search import Beam, BeamSearch, BeamSearchParams, candidates, check_length, round_params
from jaxserve.engine.engine import LLMEngine
from jaxserve.engine.output import RequestOutput
from jaxserve.lora_request import LoRARequest
from jaxserve.progress import progress_bar
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.tokenizer import chat_prompt_ids


class LLM:
    """`LLM(model=None, **engine_config)`; `model=None` is the embedded SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, *, show_progress: bool = True, **config):
        self.engine = LLMEngine(EngineConfig(model=model, **config),
                                progress=progress_bar("compiling") if show_progress else None)
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """An `LLM` over an engine already built (its model and compiled steps are reused)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        return llm

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Completes every prompt (text, or token ids); outputs come back in the prompts' order.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (engine with enable_lora)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        loras = lora_request if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(params) != len(prompts) or len(loras) != len(prompts):
            raise ValueError(f"{len(params)} sampling params and {len(loras)} LoRA requests for {len(prompts)} prompts")
        # Only the final outputs are read, so only they are made (as vLLM's LLM asks).
        params = [dataclasses.replace(sp or SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY) for sp in params]
        ids = [self.engine.add_request(p, sp, lora_request=lora) for p, sp, lora in zip(prompts, params, loras)]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
        while len(done) < len(ids):
            for output in self.engine.step():
                if output.finished:
                    done[output.request_id] = output
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [done[i] for i in ids]

    def beam_search(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                    params: BeamSearchParams) -> list[list[Beam]]:
        """vLLM's `LLM.beam_search`: each prompt's best `params.beam_width` beams, best first; the
        searches of all prompts advance together, one engine round per token."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompt_ids = [self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
                      for p in prompts]
        for ids in prompt_ids:
            check_length(len(ids), params, self.engine.max_model_len)
        searches = [BeamSearch(params, self.engine.eos_token_ids) for _ in prompt_ids]
        while not all(s.done for s in searches):
            active = [(ids, s) for ids, s in zip(prompt_ids, searches) if not s.done]
            rounds = [[ids + list(beam.tokens) for beam in s.live] for ids, s in active]
            outputs = iter(self.generate([r for beams in rounds for r in beams], round_params(params)))
            for (_, search), beams in zip(active, rounds):
                search.advance([candidates(next(outputs)) for _ in beams])
        return [s.best() for s in searches]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             **kwargs) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [chat_prompt_ids(self.tokenizer, c) for c in conversations]
        return self.generate(prompts, sampling_params, **kwargs)
