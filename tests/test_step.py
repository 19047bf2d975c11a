"""The step program's static choices (its computation is tested through the engine and the model)."""

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.engine.step import samples_from_candidates


def test_several_cpu_processes_sample_without_candidates(monkeypatch):
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    assert samples_from_candidates(None) and samples_from_candidates(mesh)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert samples_from_candidates(None)
    assert not samples_from_candidates(mesh)   # these tests' devices are CPUs
