import subprocess
import sys

PROGRAM = """
import gc, sys
from jaxserve.llm import LLM
before = gc.get_freeze_count()
llm = LLM(sys.argv[1], show_progress=False, max_num_seqs=1, max_model_len=64, num_pages=16, page_size=8,
          max_num_batched_tokens=16, prefill_segment=16)
print(before, gc.get_freeze_count())
"""


def test_an_llm_freezes_its_startup_heap(tiny_models):
    """Once `LLM` has built its engine, the objects of start-up sit outside the collector's reach
    (host_memory.freeze_startup_heap), so a full collection no longer walks them while serving.
    In a process of its own: frozen objects are never collected."""
    directory, _ = tiny_models("llama")
    result = subprocess.run([sys.executable, "-c", PROGRAM, str(directory)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = map(int, result.stdout.split()[-2:])
    assert before == 0 and after > 100_000
