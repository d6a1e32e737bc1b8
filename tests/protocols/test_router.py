"""Several models in one server, through HTTP: routing by the `model` field, the router
endpoints (GET /models, POST /models/load, POST /models/unload), /v1/models, and the `model`
label of the metrics. Two real models: SmolLM2 and Gemma 3."""
import concurrent.futures
import time

import pytest
from http_checks import assert_error
from server_process import ServerProcess

HTTP_TIMEOUT = 120


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--model", "smol=smollm2-135m-instruct", "--model", "gemma=gemma3-270m",
                       "--keep-alive", "-1", "--parallel", "4", "--ctx-size", "2048") as srv:
        yield srv


def states(http) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in http.get("/models").json()["data"]}


def metric(http, name: str, model: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f'{name}{{model="{model}"}} '):
            return float(line.split()[-1])
    return 0.0


def test_every_model_is_listed_loaded_or_not(http):
    listed = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["smol", "gemma"]
    assert set(states(http)) == {"smol", "gemma"}
    assert set(states(http).values()) <= {"unloaded", "loaded"}


def test_concurrent_first_requests_load_the_model_once(http):
    http.post("/models/unload", json={"model": "gemma"})
    assert states(http)["gemma"] == "unloaded"
    loads = metric(http, "cllm_model_loads_total", "gemma")
    body = {"model": "gemma", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: http.post("/v1/completions", json=body), range(4)))
    assert [r.status_code for r in replies] == [200] * 4
    assert {r.json()["model"] for r in replies} == {"gemma"}
    assert len({r.json()["choices"][0]["text"] for r in replies}) == 1
    assert metric(http, "cllm_model_loads_total", "gemma") == loads + 1
    assert metric(http, "cllm_model_load_seconds", "gemma") > 0
    assert states(http)["gemma"] == "loaded"


def test_each_request_reaches_the_model_it_names(http):
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8,
            "temperature": 0}
    smol = http.post("/v1/chat/completions", json={**body, "model": "smol"}).json()
    gemma = http.post("/v1/chat/completions", json={**body, "model": "gemma"}).json()
    assert smol["model"] == "smol" and gemma["model"] == "gemma"
    # The two vocabularies differ: the same prompt has a different length in each.
    assert smol["usage"]["prompt_tokens"] != gemma["usage"]["prompt_tokens"]
    default = http.post("/v1/chat/completions", json=body).json()  # no model: the first
    assert default["model"] == "smol"
    assert default["usage"]["prompt_tokens"] == smol["usage"]["prompt_tokens"]
    # smol's own prefix cache held that prompt; each model has its own.
    assert default["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert metric(http, "cllm_generation_tokens_total", "gemma") > 0
    assert metric(http, "cllm_generation_tokens_total", "smol") > 0


def test_an_unknown_model_is_a_404_everywhere(http):
    for path, body in [("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/embeddings", {"input": "Hi"}), ("/models/load", {}),
                       ("/models/unload", {})]:
        assert_error(http.post(path, json={**body, "model": "llama-70b"}), 404,
                     code="model_not_found")
    assert_error(http.get("/v1/models/llama-70b"), 404, code="model_not_found")


def test_load_and_unload_on_request(http):
    assert http.post("/models/unload", json={"model": "smol"}).json() == {"success": True}
    assert states(http)["smol"] == "unloaded"
    card = http.get("/v1/models/smol").json()
    assert card["id"] == "smol" and "meta" not in card  # unknown until loaded
    assert http.post("/models/load", json={"model": "smol"}).json() == {"success": True}
    assert states(http)["smol"] == "loaded"
    assert http.get("/v1/models/smol").json()["meta"]["n_vocab"] > 0
    r = http.post("/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200


def test_ollama_lists_every_model_and_a_requests_keep_alive_unloads_its_model(http):
    http.post("/models/load", json={"model": "smol"})
    http.post("/models/unload", json={"model": "gemma"})
    tags = {m["name"]: m for m in http.get("/api/tags").json()["models"]}
    assert set(tags) == {"smol", "gemma"}  # listed without loading gemma
    assert tags["smol"]["details"]["quantization_level"] == "Q4_1"
    assert tags["gemma"]["size"] > 0 and states(http)["gemma"] == "unloaded"
    assert [m["name"] for m in http.get("/api/ps").json()["models"]] == ["smol"]
    # Ollama's way to load a model for a while, then to unload it: empty requests.
    r = http.post("/api/generate", json={"model": "gemma", "keep_alive": "1m"})
    assert r.json()["done_reason"] == "load"
    ps = {m["name"]: m for m in http.get("/api/ps").json()["models"]}
    assert set(ps) == {"smol", "gemma"}
    assert ps["gemma"]["expires_at"] < ps["smol"]["expires_at"]  # a minute against never
    r = http.post("/api/generate", json={"model": "gemma", "keep_alive": 0})
    assert r.json()["done_reason"] == "unload"
    for _ in range(50):
        if states(http)["gemma"] == "unloaded":
            break
        time.sleep(0.1)
    assert states(http)["gemma"] == "unloaded"


@pytest.mark.parametrize("body,param", [({}, "model"), ({"model": "smol", "force": True}, "force"),
                                        ({"model": 3}, "model")])
def test_router_requests_are_checked(http, body, param):
    r = http.post("/models/load", json=body)
    assert_error(r, 400)
    assert r.json()["error"]["param"] == param


def test_a_model_that_fails_to_load_says_why_and_the_others_serve_on(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with ServerProcess("--model", "smollm2-135m-instruct", "--model", f"broken={bad}") as srv:
        with srv.http_client(HTTP_TIMEOUT) as http:
            r = http.post("/v1/completions", json={"model": "broken", "prompt": "Hi"})
            assert_error(r, 503, code="model_not_ready")
            assert "failed to load" in r.json()["error"]["message"]
            listed = {m["id"]: m["status"] for m in http.get("/models").json()["data"]}
            assert listed["broken"]["value"] == "failed" and listed["broken"]["reason"]
            r = http.post("/v1/completions", json={"model": "smollm2-135m-instruct",
                                                   "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200
            assert http.get("/health").status_code == 200
