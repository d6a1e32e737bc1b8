"""What every protocol's routes share (cllm/http/common.py), against a real server: the model a
request names."""
from __future__ import annotations

import pytest
from http_checks import assert_error
from server_process import ServerProcess

SERVED = "my-model"
ALIAS = "smollm2-135m-instruct"  # the default model's alias (cllm/models.py)
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Hi"}]

# Every route that takes `model`, with a body that asks for one token.
ROUTES = {
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 1},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 1},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 1},
    "/v1/messages": {"messages": CHAT, "max_tokens": 1},
    "/v1/embeddings": {"input": "Hi"},
    "/completion": {"prompt": "Hi", "n_predict": 1},
}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--served-model-name", SERVED, "--parallel", "2") as srv:
        yield srv


@pytest.mark.parametrize("path", list(ROUTES))
def test_any_name_of_the_model_or_none_is_served(http, path):
    for name in (SERVED, ALIAS, REPO, None, ""):
        body = ROUTES[path] if name is None else {**ROUTES[path], "model": name}
        r = http.post(path, json=body)
        assert r.status_code == 200, (name, r.text)


@pytest.mark.parametrize("path", list(ROUTES))
def test_another_model_is_a_404_model_not_found(http, path):
    r = http.post(path, json={**ROUTES[path], "model": "gpt-4o"})
    if path == "/v1/messages":  # Anthropic's error shape
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
        assert "gpt-4o" in r.json()["error"]["message"]
        return
    error = assert_error(r, 404, type_="invalid_request_error", code="model_not_found")
    assert error["param"] == "model" and "gpt-4o" in error["message"]


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_model_that_is_not_a_string_is_a_400(http, path):
    r = http.post(path, json={**ROUTES[path], "model": 5})
    assert r.status_code == 400 and "model" in r.text, r.text


def test_the_model_card_answers_to_the_alias_too(http):
    assert http.get(f"/v1/models/{ALIAS}").json()["id"] == SERVED
    assert_error(http.get("/v1/models/gpt-4o"), 404, code="model_not_found")
