"""Fill-in-the-middle prompts (cllm/http/fim.py): /infill's fields, and the 400 for a vocabulary
without FIM tokens (SmolLM2's)."""
import pytest

from cllm.errors import APIError
from cllm.http.fim import FileChunk, Infill, read_infill, require_fim


def test_infill_fields_are_read():
    body = {"input_prefix": "def f(", "input_suffix": "):\n", "prompt": "x",
            "input_extra": [{"filename": "a.py", "text": "A = 1"}, {"text": "B = 2"}]}
    assert read_infill(body) == Infill("def f(", "):\n", "x", (
        FileChunk("a.py", "A = 1"), FileChunk("tmp", "B = 2")))  # llama-server's default name
    assert read_infill({}) == Infill("", "")


@pytest.mark.parametrize("body, param", [
    ({"input_prefix": 3}, "input_prefix"), ({"input_suffix": ["x"]}, "input_suffix"),
    ({"input_extra": {"text": "x"}}, "input_extra"), ({"input_extra": [{"text": 1}]}, "input_extra"),
])
def test_bad_infill_fields_are_named(body, param):
    with pytest.raises(APIError) as info:
        read_infill(body)
    assert info.value.status == 400 and info.value.param == param


def test_a_vocabulary_without_fim_tokens_is_a_400(model):
    with pytest.raises(APIError) as info:
        require_fim(model, "input_prefix")
    assert info.value.status == 400 and info.value.code == "fim_not_supported"
    assert "fill-in-the-middle" in info.value.message
