import gc
import subprocess
import sys

import pytest

from jaxserve.host_memory import YOUNG_THRESHOLD, collector_paused

PROGRAM = """
import gc, sys
from jaxserve.config import EngineConfig
from jaxserve.serve import _build_engine
from jaxserve.server.config import ServerConfig
from jaxserve.engine.engine import LLMEngine
before = gc.get_freeze_count()
collections, during_warm_up = [], []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
warm_up = LLMEngine._warm_up
def counted(self, *args, **kwargs):
    first = len(collections)
    warm_up(self, *args, **kwargs)
    during_warm_up.append(len(collections) - first)
LLMEngine._warm_up = counted
config = EngineConfig(model=sys.argv[1], max_num_seqs=1, max_model_len=64, num_pages=16, page_size=8,
                      max_num_batched_tokens=16, prefill_segment=16)
engine = _build_engine(config, None, ServerConfig())
print(before, gc.get_freeze_count(), gc.get_threshold()[0], *during_warm_up, int(gc.isenabled()))
"""


def test_the_server_freezes_its_startup_heap(tiny_models):
    """Once the server has built its engine, the objects of start-up sit outside the collector's
    reach (host_memory.freeze_startup_heap), so a full collection no longer walks them while
    serving, and young objects are collected every YOUNG_THRESHOLD net allocations, not 700. The
    engine compiled its programs with automatic collection paused (host_memory.collector_paused):
    no collection meanwhile, where there were 65 without the pause, and the collector on again
    after. In a process of its own: frozen objects are never collected."""
    directory, _ = tiny_models("llama")
    result = subprocess.run([sys.executable, "-c", PROGRAM, str(directory)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    before, after, threshold, during_warm_up, enabled = map(int, result.stdout.split()[-5:])
    assert before == 0 and after > 100_000 and threshold == YOUNG_THRESHOLD
    assert during_warm_up == 0 and enabled == 1


FREEZE = """
import gc, weakref
from jaxserve.host_memory import freeze_startup_heap
class Node:
    pass
gc.disable()   # as a start-up under collector_paused: no collection since the cycle became garbage
node = Node()
node.self = node
alive = weakref.ref(node)
del node
gc.enable()
freeze_startup_heap()
print(alive() is None, gc.get_freeze_count() > 0)
"""


def test_freezing_the_startup_heap_collects_its_garbage_first():
    """A cycle that became garbage while the collector was paused is collected, not frozen for good."""
    result = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["True", "True"]


def test_collector_paused_turns_automatic_collection_off_inside_and_as_it_was_after():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("a failed build")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()   # left off, as it was before
    finally:
        gc.enable()
