"""float8_e4m3fn kept as bytes on a CPU: every byte decodes as float8's own conversion does, loaded
fp8 weights and the XLA backend's fp8 KV pages are stored as bytes, and a page written as bytes
reads back what a float8 page does."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxserve.checkpoint.loader import load_model
from jaxserve.engine import kv_pages as kv_pool
from jaxserve.engine.runner import Runner
from jaxserve.models.layers import float8
from jaxserve.models.layers.attention import _gather_pages, write_kv

from test_kv_pages import MODEL


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_byte_decodes_to_its_float8_value(dtype):
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    got = np.asarray(float8.values(float8.to_bytes(jnp.asarray(values)), dtype).astype(jnp.float32))
    want = values.astype(np.float32)
    np.testing.assert_array_equal(got, want)                     # NaNs in the same places
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    assert np.isnan(got).sum() == 2 and got[0x7E] == 448 and got[1] == 2.0 ** -9   # NaN, max, a subnormal


def test_on_a_cpu_float8_arrays_are_stored_as_bytes(tiny_models):
    assert jax.default_backend() == "cpu"
    stored = float8.as_stored({"w": jnp.ones(4, jnp.float8_e4m3fn), "scale": jnp.ones(3), "q": jnp.ones(2, jnp.int8)})
    assert [stored[k].dtype for k in ("w", "scale", "q")] == [jnp.uint8, jnp.float32, jnp.int8]
    assert float8.stored_dtype(jnp.float8_e4m3fn) == jnp.uint8 and float8.stored_dtype(jnp.int8) == jnp.int8
    model = load_model(str(tiny_models("llama")[0]), "float32", quantization="fp8")
    values = {"/".join(map(str, path)): v.get_value().dtype for path, v in nnx.to_flat_state(model.params)
              if path[-1] == "value"}
    assert len(values) == 7 and set(values.values()) == {jnp.dtype(jnp.uint8)}, values
    pools = {backend: Runner(model, 8, 4, 32, 2, 32, 16, attention_backend=backend, kv_cache_dtype="fp8").kv_pages
             for backend in ("xla", "pallas")}
    assert pools["xla"].k.dtype == jnp.uint8 and pools["pallas"].k.dtype == jnp.float8_e4m3fn   # the kernels' own


def test_pages_written_as_bytes_read_back_the_float8_pages_values():
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.normal(size=(6, 2, 64)) * s, jnp.float32) for s in (300.0, 0.05))  # some past 448
    slots = jnp.asarray([4, 5, 6, 9, 12, 31], jnp.int32)
    pages = jnp.asarray([[1, 2], [3, 7]], jnp.int32)
    read = {}
    for dtype in (jnp.float8_e4m3fn, jnp.uint8):
        pool = write_kv(kv_pool.allocate(MODEL, 8, 4, jnp.dtype(dtype)), k, v, jnp.int32(1), slots)
        assert pool.k.dtype == dtype
        read[dtype] = [np.asarray(_gather_pages(p, jnp.int32(1), pages)) for p in (pool.k, pool.v)]
    for as_float8, as_bytes in zip(read[jnp.float8_e4m3fn], read[jnp.uint8]):
        np.testing.assert_array_equal(as_bytes, as_float8)
    assert np.abs(read[jnp.uint8][0]).max() == 448 and not np.isnan(read[jnp.uint8][0]).any()   # clipped
