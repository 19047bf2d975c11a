"""`jaxserve bench serve`'s tables (one run, and a comparison of configurations) and its plot."""

from __future__ import annotations

from pathlib import Path

PERCENTILES = (50, 95, 99)


def _mode(summary: dict) -> str:
    return (f"concurrency {summary['concurrency']}" if not summary["request_rate"]
            else f"{summary['request_rate']} req/s Poisson" + (f", concurrency <= {summary['concurrency']}"
                                                              if summary["concurrency"] else ""))


def _hit_rate(counters: dict[str, float]) -> float | None:
    return counters["prefix_cache_hits"] / counters["prefix_cache_queries"] \
        if counters.get("prefix_cache_queries") else None


def print_table(summary: dict) -> None:
    print(f"\n{summary['model']} at {summary['base_url']}, {_mode(summary)}: {summary['requests']} requests "
          f"({summary['failed']} failed) in {summary['duration_s']:.1f} s")
    print(f"  {summary['requests_per_s']:.2f} requests/s, {summary['output_tokens_per_s']:.1f} output tokens/s "
          f"({summary['output_tokens']} of {summary['expected_output_tokens']} expected tokens)")
    print(f"  {'ms':<24}{'mean':>10}" + "".join(f"{'p' + str(p):>10}" for p in PERCENTILES))
    for key, name in (("ttft_s", "time to first token"), ("tpot_s", "time per output token"),
                      ("itl_s", "inter-token latency"), ("e2e_s", "end-to-end latency")):
        row = summary[key]
        print(f"  {name:<24}" + "".join(f"{row[k] * 1000:>10.1f}" if row[k] is not None else f"{'-':>10}"
                                        for k in ("mean", *(f"p{p}" for p in PERCENTILES))))
    counters = summary["server_counters"]
    if counters:
        hits = _hit_rate(counters)
        print(f"  server: {counters.get('prefix_cache_queries', 0):.0f} prompt tokens looked up in the prefix cache"
              + (f", {hits:.1%} found" if hits is not None else "")
              + f"; {counters.get('num_preemptions', 0):.0f} preemptions")
    acceptance = _speculation(counters)
    if acceptance:
        print(f"  speculative decoding: {acceptance}")
    for error in summary["errors"]:
        print(f"  error: {error}")


def _speculation(counters: dict[str, float]) -> str | None:
    """Acceptance rate (drafts kept / proposed) and mean accepted length (tokens per verifying
    step, the bonus token included), vLLM's two figures."""
    proposed, drafts = counters.get("spec_decode_num_draft_tokens"), counters.get("spec_decode_num_drafts")
    if not proposed:
        return None
    accepted = counters["spec_decode_num_accepted_tokens"]
    return (f"{drafts:.0f} drafts of {proposed:.0f} tokens, acceptance rate {accepted / proposed:.3f}, "
            f"mean accepted length {1 + accepted / drafts:.2f}")


def print_workload_comparison(summaries: list[dict], labels: list[str]) -> None:
    """One row per configuration, then each one's ratios against the first."""
    first = summaries[0]
    warmup = (f"{first['warmup_requests']} untimed warm-up request(s) (the first rows, 1 output token) before "
              f"timing on every server" if first["warmup_requests"] else "no warm-up (each server starts cold)")
    print(f"\ncomparison, {Path(first['workload']).name}, {_mode(first)}, {first['requests']} requests each; "
          f"{warmup}; server start-up not timed; latencies in ms")
    width = max(len("configuration"), *(len(label) for label in labels)) + 2
    columns = ("out tok/s", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99",
               "prefix hit", "preempt", "failed")
    print(f"  {'configuration':<{width}}" + "".join(f"{c:>11}" for c in columns))

    def values(s: dict) -> list[float | None]:
        return [s["output_tokens_per_s"], s["requests_per_s"], *(s[key][p] for key in ("ttft_s", "tpot_s", "itl_s")
                                                                 for p in ("p50", "p99"))]

    for label, summary in zip(labels, summaries):
        rate, per_s, *latencies = values(summary)
        counters, hits = summary["server_counters"], _hit_rate(summary["server_counters"])
        print(f"  {label:<{width}}{rate:>11.1f}{per_s:>11.2f}"
              + "".join(f"{v * 1000:>11.1f}" if v is not None else f"{'-':>11}" for v in latencies)
              + (f"{hits:>11.1%}" if hits is not None else f"{'-':>11}")
              + (f"{counters['num_preemptions']:>11.0f}" if "num_preemptions" in counters else f"{'-':>11}")
              + f"{summary['failed']:>11}")
    for label, summary in zip(labels[1:], summaries[1:]):
        ratios = [a / b if a is not None and b else None for a, b in zip(values(summary), values(first))]
        print(f"  {label.split()[0] + ' / ' + labels[0].split()[0]:<{width}}"
              + "".join(f"{r:>10.2f}x" if r is not None else f"{'-':>11}" for r in ratios))
    for label, summary in zip(labels, summaries):
        acceptance = _speculation(summary["server_counters"])
        if acceptance:
            print(f"  {label.split()[0]} speculative decoding: {acceptance}")


def plot(results: list, summary: dict, path: Path) -> bool:
    """Histograms of TTFT, TPOT, ITL and e2e (ms) of `jaxserve bench serve` `Result`s; False if matplotlib is
    missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    done = [r for r in results if r.error is None]
    series = {"time to first token": [r.ttft for r in done if r.ttft is not None],
              "time per output token": [r.tpot for r in done if r.tpot is not None],
              "inter-token latency": [gap for r in done for gap in r.itl],
              "end-to-end latency": [r.e2e for r in done]}
    figure, axes = plt.subplots(1, 4, figsize=(18, 4))
    for axis, (name, values) in zip(axes, series.items()):
        axis.hist([v * 1000 for v in values], bins=40)
        axis.set_title(name)
        axis.set_xlabel("ms")
    axes[0].set_ylabel("count")
    figure.suptitle(f"{summary['model']}: {summary['requests_per_s']:.2f} req/s, "
                    f"{summary['output_tokens_per_s']:.1f} output tok/s")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True
