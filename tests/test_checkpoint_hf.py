"""Safetensors reading against the state dict of a tiny random transformers Llama."""

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from jaxserve.checkpoint.hf import iter_safetensors, read_hf_config


def _tiny_llama(dtype=torch.float32):
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def test_sharded_float32_checkpoint(tmp_path):
    model = _tiny_llama()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "test meant to exercise a sharded checkpoint"
    tensors = dict(iter_safetensors(tmp_path))
    expected = model.state_dict()
    assert tensors.keys() == expected.keys()
    for name, value in expected.items():
        assert tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], value.numpy(), err_msg=name)
    config = read_hf_config(tmp_path)
    assert config["model_type"] == "llama" and config["hidden_size"] == 32


def test_bfloat16_checkpoint(tmp_path):
    model = _tiny_llama(torch.bfloat16)
    model.save_pretrained(tmp_path)
    tensors = dict(iter_safetensors(tmp_path))
    expected = model.state_dict()
    assert tensors.keys() == expected.keys()
    for name, value in expected.items():
        assert tensors[name].dtype == ml_dtypes.bfloat16
        assert tensors[name].shape == tuple(value.shape)
        np.testing.assert_array_equal(tensors[name].astype(np.float32), value.float().numpy(), err_msg=name)


def test_unindexed_safetensors_files_are_all_read(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.arange(3, dtype=np.float32)}, str(tmp_path / "part-a.safetensors"))
    save_file({"b": np.ones((2, 2), dtype=np.int64)}, str(tmp_path / "part-b.safetensors"))
    tensors = dict(iter_safetensors(tmp_path))
    assert sorted(tensors) == ["a", "b"] and tensors["b"].dtype == np.int64


def test_missing_weights_error_names_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}.*model\.safetensors.*index\.json"):
        list(iter_safetensors(tmp_path))
