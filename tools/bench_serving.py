"""`jaxserve bench serve` under its old path (see jaxserve/bench/serve.py)."""

import sys

from jaxserve.bench.serve import main

if __name__ == "__main__":
    sys.exit(main(prog="tools/bench_serving.py"))
