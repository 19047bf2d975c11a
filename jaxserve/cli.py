"""`jaxserve`, the console command: one entry point for the server, generation, conversion, keys and
benchmarks, as `vllm serve` / `vllm bench serve` are vLLM's.

    jaxserve serve [MODEL] [flags]          the OpenAI-compatible server (= python -m jaxserve.serve)
    jaxserve generate PROMPT [flags]        one completion on the terminal
    jaxserve convert SOURCE OUT [flags]     a checkpoint into a directory that loads fast
    jaxserve keys DIR --num-processes N     CURVE keys for serving from several processes
    jaxserve bench serve|offline [flags]    the serving and offline benchmarks

`jaxserve COMMAND --help` lists each command's flags.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

# command -> (module, what it does); each module's `main(argv, prog)` parses the rest
COMMANDS = {
    "serve": ("jaxserve.serve", "the OpenAI-compatible server"),
    "generate": ("jaxserve.generate", "one completion on the terminal"),
    "convert": ("jaxserve.convert", "convert a checkpoint into a directory that loads fast"),
    "keys": ("jaxserve.distributed", "CURVE keys for serving from several processes"),
    "bench": (None, "the serving and offline benchmarks (jaxserve bench serve|offline)"),
}
BENCHMARKS = {
    "serve": ("jaxserve.bench.serve", "replay a workload against an OpenAI-compatible server"),
    "offline": ("jaxserve.bench.offline", "replay a workload through LLM.generate"),
}


def _usage(prog: str, commands: dict) -> str:
    lines = [f"usage: {prog} {{{','.join(commands)}}} ...", ""]
    lines += [f"  {name:<10} {about}" for name, (_, about) in commands.items()]
    return "\n".join(lines + ["", f"`{prog} COMMAND --help` lists each command's flags."])


def _dispatch(prog: str, commands: dict, argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(prog, commands), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if prog == "jaxserve" and name == "bench":
        return _dispatch("jaxserve bench", BENCHMARKS, rest)
    if prog == "jaxserve" and name in ("--version", "-V"):
        print(f"jaxserve {importlib.metadata.version('jaxserve')}")
        return 0
    if name not in commands:
        print(f"{prog}: error: unknown command {name!r}; choose from {list(commands)}", file=sys.stderr)
        return 2
    module = importlib.import_module(commands[name][0])
    if name == "keys":   # the one subcommand of jaxserve.distributed's own command line
        return module.main(["keys", *rest], prog=prog)
    return module.main(rest, prog=f"{prog} {name}")


def main(argv: list[str] | None = None) -> int:
    return _dispatch("jaxserve", COMMANDS, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
