"""`jaxserve bench offline` under its old path (see jaxserve/bench/offline.py)."""

import sys

from jaxserve.bench.offline import main

if __name__ == "__main__":
    sys.exit(main(prog="tools/bench_offline.py"))
