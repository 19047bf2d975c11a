"""`python -m jaxserve.convert`: the converted directory loads to the very same weights."""

import jax
import numpy as np
import pytest

from jaxserve.checkpoint.loader import load_model
from jaxserve.convert import main


def assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_hf_directory_round_trips(tiny_models, tmp_path, capsys):
    source = tiny_models("qwen2")[0]
    assert main([str(source), str(tmp_path / "out")]) == 0
    assert "--model" in capsys.readouterr().out
    original, converted = load_model(str(source), "float32"), load_model(str(tmp_path / "out"), "float32")
    assert converted.config == original.config
    assert_same_params(original, converted)
    text = "Prices rose 12.5% in 2024 and 3 of 10 said so."
    assert converted.tokenizer.encode(text) == original.tokenizer.encode(text)


def test_an_int8_mixture_of_experts_round_trips(tiny_models, tmp_path):
    source = tiny_models("qwen2_moe")[0]
    assert main([str(source), str(tmp_path / "out"), "--quantization", "int8"]) == 0
    original = load_model(str(source), "float32", quantization="int8")
    converted = load_model(str(tmp_path / "out"), "float32")
    assert converted.config == original.config and converted.formats == original.formats
    assert "layers/gate_experts" in converted.formats
    assert_same_params(original, converted)


def test_int4_round_trips_and_a_version_1_int4_directory_is_refused(tiny_models, tmp_path):
    """Version 1 packed 4-bit values by halves of the rows: read by pairs they are other weights."""
    source = tiny_models("llama")[0]
    assert main([str(source), str(tmp_path / "out"), "--quantization", "int4"]) == 0
    original = load_model(str(source), "float32", quantization="int4")
    converted = load_model(str(tmp_path / "out"), "float32")
    assert converted.formats == original.formats and {f.kind for f in converted.formats.values()} == {"uint4"}
    assert_same_params(original, converted)
    marker = tmp_path / "out" / "jaxserve.json"
    marker.write_text(marker.read_text().replace('"version": 2', '"version": 1'))
    with pytest.raises(ValueError, match="convert the source checkpoint again"):
        load_model(str(tmp_path / "out"), "float32")


def test_bfloat16_checkpoint_restores_in_the_engine_dtype(tiny_models, tmp_path):
    main([str(tiny_models("llama")[0]), str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    model = load_model(str(tmp_path / "bf16"), "float32")
    assert {x.dtype for x in jax.tree.leaves(model.params)} == {np.dtype("float32")}


def test_refuses_a_non_empty_output_directory(tiny_models, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        main([str(tiny_models("llama")[0]), str(tmp_path / "taken")])


@pytest.mark.slow
def test_embedded_gguf_converts_to_the_same_weights(smollm2, tmp_path):
    main(["default", str(tmp_path / "smollm2")])     # its own Q4_1 and Q8_0 weights, as they are
    converted = load_model(str(tmp_path / "smollm2"), "float32")
    assert converted.formats == smollm2.formats and smollm2.formats["layers/q_proj"].name == "Q4_1"
    assert_same_params(smollm2, converted)
    assert converted.tokenizer.encode("room 101, 2024") == smollm2.tokenizer.encode("room 101, 2024")
