"""16 concurrent streaming clients on the embedded SmolLM2: complete replies equal to `LLM.generate`."""

import asyncio
import json

import aiohttp
import pytest

from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams
from server_fixtures import serving, smollm2_engine  # noqa: F401 - fixture

TOPICS = ["the sea", "a violin", "Mount Everest", "bread", "the moon", "a bicycle", "rain", "chess", "coffee",
          "a lighthouse", "autumn", "the piano", "volcanoes", "a library", "snow", "the desert"]
PROMPTS = [f"Here is a short fact about {topic}:" for topic in TOPICS]
MAX_TOKENS = 24


async def stream_completion(session, url: str, prompt: str) -> tuple[str, str, int]:
    """(text, finish reason, completion tokens) of one streamed /v1/completions request."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, reason, tokens = "", None, None
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        assert reply.status == 200
        async for line in reply.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            for choice in chunk["choices"]:
                text += choice["text"]
                reason = choice["finish_reason"] or reason
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return text, reason, tokens


@pytest.mark.slow
def test_16_concurrent_streams_equal_llm_generate(smollm2_engine):
    expected = LLM.from_engine(smollm2_engine).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    with serving(smollm2_engine) as server:
        async def clients():
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(*(stream_completion(session, server.url, p) for p in PROMPTS))
        replies = asyncio.run(clients())
        after = server.async_engine.stats
    for prompt, reference, (text, reason, tokens) in zip(PROMPTS, expected, replies):
        [sample] = reference.outputs
        assert (text, reason, tokens) == (sample.text, sample.finish_reason, len(sample.token_ids)), prompt
    assert after.num_running == 0 and after.kv_cache_usage == 0
