"""`jaxserve bench serve`'s `--scenario long-prompt`: how long one long prompt stalls the streams already running.

`--streams` K streams start (each a workload row's last `--short-prompt-len` token ids, many
output tokens, EOS ignored, greedy). Once every one of them has two tokens (it is decoding) and
`--baseline-s` more has passed, one prompt of `--long-prompt-len` token ids (the workload's
prompts laid end to end, so every id is a real one) arrives. The gaps between the K streams'
tokens (ITL) are reported over three spans:

    before     all K decoding .. the long prompt's arrival (the steady state)
    window     gaps that overlap arrival .. the long prompt's first token: where a prefill that
               is not chunked freezes every stream for one long step
    overall    all K decoding .. the end (`--tail-s` after the long prompt finished)

The streams are then cancelled (the server aborts them). The server must admit K + 1 sequences
at once (`--max-num-seqs` > K), or the long prompt waits for a stream to end.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time

import aiohttp


def prompts(rows: list[dict], args) -> tuple[list[list[int]], list[int]]:
    """The K short prompts and the long one, all from the workload's token ids."""
    short = [rows[i % len(rows)]["prompt_token_ids"][-args.short_prompt_len:] for i in range(args.streams)]
    every_id = itertools.cycle([t for row in rows for t in row["prompt_token_ids"]])
    return short, list(itertools.islice(every_id, args.long_prompt_len))


def body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}


async def stream(session: aiohttp.ClientSession, url: str, body: dict, times: list[float],
                 decoding: asyncio.Event) -> str | None:
    """Streams one completion, appending each token's arrival time to `times`; sets `decoding`
    at the second token (or when the stream ends). Returns an error, or None."""
    try:
        async with session.post(url, json=body) as reply:
            if reply.status != 200:
                return f"HTTP {reply.status}: {(await reply.text())[:200]}"
            async for line in reply.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if chunk.get("error"):
                    return str(chunk["error"])
                if any(choice.get("text") for choice in chunk.get("choices") or []):
                    times.append(time.perf_counter())
                    if len(times) == 2:
                        decoding.set()
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        decoding.set()  # a stream that ends early must not hold the others up
    return None


def spread(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p99": None, "max": None}
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"count": len(values), "mean": statistics.fmean(values), "p50": cuts[49], "p99": cuts[98],
            "max": max(values)}


async def run(base_url: str, model: str, rows: list[dict], args, headers: dict) -> dict:
    """The scenario against one server; a summary dict (times in seconds)."""
    short, long = prompts(rows, args)
    url = f"{base_url}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        max_tokens = args.stream_max_tokens or await _stream_max_tokens(session, base_url, args.short_prompt_len)
        times: list[list[float]] = [[] for _ in short]
        decoding = [asyncio.Event() for _ in short]
        tasks = [asyncio.create_task(stream(session, url, body(model, p, max_tokens), t, d))
                 for p, t, d in zip(short, times, decoding)]
        await asyncio.wait_for(asyncio.gather(*(d.wait() for d in decoding)), args.timeout)
        all_decoding = time.perf_counter()
        await asyncio.sleep(args.baseline_s)
        arrived = time.perf_counter()
        long_times: list[float] = []
        long_error = await stream(session, url, body(model, long, args.long_max_tokens), long_times, asyncio.Event())
        await asyncio.sleep(args.tail_s)
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [o for o in outcomes if isinstance(o, str)] + ([f"long prompt: {long_error}"] if long_error else [])
    first = long_times[0] if long_times else None
    before, window, overall = [], [], []
    for a, b in (pair for t in times for pair in zip(t, t[1:]) if pair[0] >= all_decoding):
        overall.append(b - a)
        if b <= arrived:
            before.append(b - a)
        if first is not None and b > arrived and a < first:
            window.append(b - a)
    return {
        "scenario": "long-prompt", "base_url": base_url, "model": model, "workload": str(args.workload),
        "streams": len(short), "short_prompt_tokens": args.short_prompt_len, "stream_max_tokens": max_tokens,
        "long_prompt_tokens": len(long), "long_max_tokens": args.long_max_tokens,
        "long_output_tokens": len(long_times), "long_ttft_s": first - arrived if first else None,
        "long_e2e_s": long_times[-1] - arrived if long_times else None,
        "stream_tokens_in_window": len(window) / len(short),
        "streams_ended_early": sum(1 for t in times if first is None or not t or t[-1] < first),
        "failed": len(errors), "errors": errors[:5],
        "itl_before_s": spread(before), "itl_window_s": spread(window), "itl_overall_s": spread(overall),
        # token arrival times relative to the long prompt's arrival, to see where a stall sits
        "long_token_times_s": [round(t - arrived, 4) for t in long_times],
        "stream_token_times_s": [[round(t - arrived, 4) for t in ts] for ts in times],
    }


async def _stream_max_tokens(session: aiohttp.ClientSession, base_url: str, prompt_len: int) -> int:
    """1024, or less if the served context (`max_model_len` in /v1/models) is shorter."""
    async with session.get(f"{base_url}/v1/models") as reply:
        card = (await reply.json())["data"][0] if reply.status == 200 else {}
    return min(1024, (card.get("max_model_len") or 1 << 30) - prompt_len)


def _ms(value: float | None, width: int) -> str:
    return f"{value * 1000:>{width}.1f}" if value is not None else f"{'-':>{width}}"


def print_table(summary: dict) -> None:
    ttft = f"{summary['long_ttft_s']:.2f} s" if summary["long_ttft_s"] is not None else "never"
    print(f"\n{summary['model']} at {summary['base_url']}: {summary['streams']} streams decoding, then one "
          f"{summary['long_prompt_tokens']}-token prompt; its first token after {ttft}, "
          f"{summary['stream_tokens_in_window']:.1f} tokens per stream meanwhile")
    print(f"  {'inter-token latency, ms':<34}{'count':>7}" + "".join(f"{k:>9}" for k in ("mean", "p50", "p99", "max")))
    for key, name in (("itl_before_s", "before the long prompt"), ("itl_window_s", "until its first token"),
                      ("itl_overall_s", "overall")):
        row = summary[key]
        print(f"  {name:<34}{row['count']:>7}" + "".join(_ms(row[k], 9) for k in ("mean", "p50", "p99", "max")))
    if summary["streams_ended_early"]:
        print(f"  warning: {summary['streams_ended_early']} streams ended before the long prompt's first token "
              f"(raise --stream-max-tokens, or --max-num-seqs on the server)")
    for error in summary["errors"]:
        print(f"  error: {error}")


def print_comparison(summaries: list[dict], labels: list[str]) -> None:
    """One row per configuration, then each one's ratios against the first."""
    first = summaries[0]
    print(f"\ncomparison, long prompt: {first['streams']} streams ({first['short_prompt_tokens']}-token prompts) "
          f"decoding, then one {first['long_prompt_tokens']}-token prompt ({first['long_max_tokens']} tokens "
          f"out); server start-up not timed; ITL of the {first['streams']} streams in ms: win = gaps that "
          f"overlap its arrival .. first token (win tokens: their count per stream), all = every gap")
    width = max(len("configuration"), *(len(label) for label in labels)) + 2
    columns = ("long TTFT s", "win tokens", "win p50", "win p99", "win max", "all p50", "all p99", "all max")
    print(f"  {'configuration':<{width}}" + "".join(f"{c:>12}" for c in columns))

    def values(s: dict) -> list[float | None]:
        window, overall = s["itl_window_s"], s["itl_overall_s"]
        return [s["long_ttft_s"], s["stream_tokens_in_window"], window["p50"], window["p99"], window["max"],
                overall["p50"], overall["p99"], overall["max"]]

    for label, summary in zip(labels, summaries):
        cells = values(summary)
        print(f"  {label:<{width}}" + f"{_plain(cells[0], 12, 2)}{_plain(cells[1], 12, 1)}"
              + "".join(_ms(v, 12) for v in cells[2:]))
    for index, summary in enumerate(summaries[1:], 1):
        ratios = [a / b if a is not None and b else None for a, b in zip(values(summary), values(first))]
        print(f"  {f'[{index}] / [0]':<{width}}" + "".join(f"{r:>11.2f}x" if r is not None else f"{'-':>12}"
                                                          for r in ratios))


def _plain(value: float | None, width: int, digits: int) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"
