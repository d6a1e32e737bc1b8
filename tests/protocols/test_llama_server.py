"""llama-server's /completion body (cllm/protocols/llama_server.py), without a model; /infill on
the real server."""
import httpx
import pytest
from server_process import ServerProcess

from cllm.errors import APIError
from cllm.protocols.llama_server import SAMPLING_DEFAULTS, parse_completion, timings


def parse(**fields):
    return parse_completion({"prompt": "Hello", **fields}, max_tokens_limit=1000)


def test_llama_server_defaults_apply_to_fields_left_out_or_null():
    req = parse(top_k=None)
    s = req.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == tuple(
        SAMPLING_DEFAULTS[k] for k in ("temperature", "top_k", "top_p", "min_p"))
    assert s.max_tokens == 1000  # n_predict -1: until the context is full
    assert not req.stream and req.cache_prompt and not req.return_tokens


def test_fields_given_win():
    req = parse(n_predict=7, temperature=0, top_k=0, stream=True, return_tokens=True,
                cache_prompt=False, stop=["\n"], seed=3)
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.stop, s.seed) == (7, 0.0, 0, ("\n",), 3)
    assert req.stream and req.return_tokens and not req.cache_prompt


def test_max_tokens_is_read_when_n_predict_is_absent():
    assert parse(max_tokens=5).sampling.max_tokens == 5
    assert parse(n_predict=6, max_tokens=5).sampling.max_tokens == 6


def test_n_predict_past_the_context_is_clamped_to_it():
    assert parse(n_predict=4096).sampling.max_tokens == 1000
    assert parse(max_tokens=10**30).sampling.max_tokens == 1000


def test_samplers_cllm_lacks_are_accepted_at_the_values_that_leave_them_off():
    req = parse(mirostat=0, typical_p=1.0, dynatemp_range=0.0, xtc_probability=0,
                dry_multiplier=0.0)
    assert req.sampling == parse().sampling


def test_token_id_prompts():
    assert parse_completion({"prompt": [1, 2, 3]}, max_tokens_limit=10).prompt == [1, 2, 3]


@pytest.mark.parametrize("fields, param", [
    ({"n_predict": 0}, "n_predict"),
    ({"n_predict": "5"}, "n_predict"), ({"prompt": ""}, "prompt"), ({"prompt": None}, "prompt"),
    ({"temperature": -1}, "temperature"), ({"n_probs": 3}, "n_probs"),
    ({"return_tokens": "yes"}, "return_tokens"),
    ({"mirostat": 2}, "mirostat"), ({"typical_p": 0.5}, "typical_p"),  # would change the output
    ({"dry_multiplier": 0.8}, "dry_multiplier"),
])
def test_rejections_name_the_field(fields, param):
    with pytest.raises(APIError) as info:
        parse(**fields)
    assert info.value.status == 400 and info.value.param == param


def test_timings_split_at_the_first_token():
    t = timings(10, 5, {"ttft": 0.5, "total": 1.5})
    assert t["prompt_n"] == 10 and t["prompt_ms"] == 500 and t["prompt_per_second"] == 20
    assert t["predicted_n"] == 5 and t["predicted_ms"] == 1000 and t["predicted_per_second"] == 5
    assert timings(3, 0, {})["predicted_per_second"] == 0.0


def test_infill_is_a_400_naming_the_missing_fim_tokens():
    """SmolLM2's vocabulary has no fill-in-the-middle tokens: /infill says so, in /completion's
    error shape, and the server goes on serving."""
    with ServerProcess() as srv:
        r = httpx.post(srv.url + "/infill", json={"input_prefix": "def f(", "input_suffix": ")"})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "fim_not_supported"
        assert r.json()["error"]["param"] == "input_prefix"
        ok = httpx.post(srv.url + "/completion", json={"prompt": "def f(", "n_predict": 2},
                        timeout=60)
        assert ok.status_code == 200 and ok.json()["tokens_predicted"] == 2
