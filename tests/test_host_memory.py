import subprocess
import sys

from jaxserve.host_memory import YOUNG_THRESHOLD

PROGRAM = """
import gc, sys
from jaxserve.config import EngineConfig
from jaxserve.serve import _build_engine
from jaxserve.server.config import ServerConfig
before = gc.get_freeze_count()
config = EngineConfig(model=sys.argv[1], max_num_seqs=1, max_model_len=64, num_pages=16, page_size=8,
                      max_num_batched_tokens=16, prefill_segment=16)
engine = _build_engine(config, None, ServerConfig())
print(before, gc.get_freeze_count(), gc.get_threshold()[0])
"""


def test_the_server_freezes_its_startup_heap(tiny_models):
    """Once the server has built its engine, the objects of start-up sit outside the collector's
    reach (host_memory.freeze_startup_heap), so a full collection no longer walks them while
    serving, and young objects are collected every YOUNG_THRESHOLD net allocations, not 700. In a
    process of its own: frozen objects are never collected."""
    directory, _ = tiny_models("llama")
    result = subprocess.run([sys.executable, "-c", PROGRAM, str(directory)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    before, after, threshold = map(int, result.stdout.split()[-3:])
    assert before == 0 and after > 100_000 and threshold == YOUNG_THRESHOLD
