"""The tokenizer.json built from a GGUF tokenizes as llama.cpp does (the real default model)."""
from pathlib import Path

import pytest

from cllm.bench.tokenizer import build

TEXTS = ["Hello, world!", "Prices rose 12.5% in 2024 — from $1,999 to $2,249.",
         "def f(x):\n    return x ** 2  # square\n\n\n", "Ünïcödé 你好 🙂 naïve café",
         "  leading and trailing spaces  ", "<|im_start|>user\nHi<|im_end|>\n",
         "It's, we'll, they've, I'd", "tabs\tand\r\nnewlines"]


@pytest.fixture(scope="module")
def exported(model_path):
    return build(Path(model_path))


@pytest.mark.parametrize("text", TEXTS)
def test_the_exported_tokenizer_matches_llama_cpp(exported, model, text):
    expected = list(model.tokenize(text, add_special=False, parse_special=True))
    assert exported.encode(text, add_special_tokens=False).ids == expected
    assert exported.decode(expected, skip_special_tokens=False) == text


def test_other_tokenizers_are_refused(tmp_path):
    """A SentencePiece vocabulary (Gemma's, Llama 2's) is not approximated."""
    import gguf
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "▁a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SystemExit, match="GPT-2-style BPE only"):
        build(path)
