"""bench/gpu/synth_models.py: the real architectures' parameter counts, and llama.cpp loading a
small model written the same way, with the real vocabulary, tokenizing and detokenizing."""
import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest

from cllm.llama import _core

_PATH = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "synth_models.py"
_spec = importlib.util.spec_from_file_location("synth_models", _PATH)
synth = sys.modules["synth_models"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(synth)

# The parameter counts of the Hugging Face checkpoints.
PARAMETERS = {"llama-3.2-1b": 1_235_814_400, "qwen2.5-3b": 3_085_938_688,
              "llama-3.1-8b": 8_030_261_248}


@pytest.mark.parametrize("name", PARAMETERS)
def test_shapes_add_up_to_the_real_models_parameters(name):
    shapes = synth.tensor_shapes(synth.ARCHS[name])
    shapes.pop("rope_freqs.weight", None)  # llama.cpp's precomputed rope factors, not weights
    assert sum(math.prod(s) for s in shapes.values()) == PARAMETERS[name]


@pytest.mark.parametrize("name", PARAMETERS)
def test_vocabulary_has_the_real_size_and_special_ids(name):
    a = synth.ARCHS[name]
    tokens, types, merges = synth.vocabulary(a)
    assert len(tokens) == len(types) == a.n_vocab and len(set(tokens)) == a.n_vocab
    assert len(merges) == a.n_regular - 256
    known = set(tokens[:a.n_regular])
    assert all(m.replace(" ", "") in known for m in merges)  # every merge makes a token
    assert tokens[a.eos] in ("<|eot_id|>", "<|im_end|>")


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-3b"])
def test_llama_cpp_loads_a_small_model_of_the_real_vocabulary(name, tmp_path):
    """Two layers of 64 wide, the architecture's vocabulary and tokenizer: llama.cpp checks every
    tensor's shape as it loads, tokenizes a prompt and gives the same text back."""
    a = dataclasses.replace(synth.ARCHS[name], n_embd=64, n_ff=128, n_layer=2, n_head=4,
                            n_head_kv=2)
    path = tmp_path / f"{name}.gguf"
    synth.write(a, str(path), threads=2, seed=0)
    model = _core.Model(str(path), n_gpu_layers=0)
    assert model.n_vocab == a.n_vocab
    text = "Hello, world! Ünïcödé ✓"
    tokens = model.tokenize(text, add_special=True)
    assert (tokens[0] == a.bos) is a.add_bos
    assert model.detokenize(tokens[1:] if a.add_bos else tokens) == text
    assert a.eos in model.eog_tokens
