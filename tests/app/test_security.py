"""Security properties of the server, end to end against real `python -m cllm.serve` processes.

What tests/app/test_server.py already covers is not repeated here (a missing, wrong or
differently-cased key; bodies over a small limit; max_tokens over a small context; a missing or non-GGUF model).
Here: near-miss API keys, the default bind address, the request bounds at their edges, the chat
template sandbox against hostile templates in a GGUF, a truncated model file, and the pinned
versions of the dependencies that guard the sandbox."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # pytest's own dependency

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from http_checks import StreamGaps, assert_error
from server_process import ServerProcess, listening, serve_command, server_env

from cllm.config import MAX_STOP_LENGTH, MAX_STOP_STRINGS, ServerConfig

KEY = "s3cret-Key_0123456789"
CTX = 512  # one sequence gets it all: max_tokens may be at most 512
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--api-key", KEY, "--ctx-size", str(CTX), "--parallel", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with server.http_client(60, api_key=KEY) as client:
        yield client


# ---- (a) the API key: near misses are refused ----

NEAR_MISSES = [  # Authorization header values
    f"Bearer {KEY[:-1]}1",      # differs in the last character only
    f"Bearer {KEY[:-1]}",       # a prefix of the key
    f"Bearer {KEY[:1]}",        # a one-character prefix
    f"Bearer {KEY}{KEY}",       # the key twice
    f"Bearer  {KEY}",           # two spaces after Bearer
    f"Bearer\t{KEY}",           # a tab for the space
    f"Bearer {KEY} x",          # something after the key
    "Bearer",                   # no key at all
    # A trailing space cannot be part of the key: HTTP strips a header value's trailing
    # whitespace (RFC 9110 5.5), and httpx refuses to send it.
]


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/v1/models", None), ("GET", "/metrics", None),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
    ("POST", "/generate", {"prompt": "Hi", "max_tokens": 1}),
    ("POST", "/tokenize", {"content": "Hi"}), ("POST", "/detokenize", {"tokens": [1]}),
])
def test_near_miss_keys_are_refused(server, method, path, body):
    with server.http_client(60) as raw:
        for value in NEAR_MISSES:
            r = raw.request(method, path, json=body, headers={"Authorization": value})
            error = assert_error(r, 401, generate=path == "/generate")
            assert KEY not in r.text and KEY[:-1] not in r.text  # the key is never echoed
            assert error["type"] == "authentication_error"
        r = raw.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text


def test_with_an_api_key_any_host_header_is_served(http):
    """The key, not the Host header, guards a server that has one (it may sit behind a proxy or
    a DNS name of its own)."""
    assert http.get("/v1/models", headers={"Host": "cllm.example:443"}).status_code == 200


def test_health_needs_no_key_but_nothing_else_hides_behind_it(server):
    with server.http_client(60) as raw:
        assert raw.get("/health").status_code == 200
        for path in ("/health/", "/health/../metrics", "/%6detrics", "/v1/models?/health"):
            assert raw.get(path).status_code == 401, path


# ---- (b) the bind address ----

def test_binds_loopback_by_default(server):
    assert ServerConfig().host == "127.0.0.1"
    help_text = subprocess.run(serve_command() + ["--help"], capture_output=True, text=True,
                               env=server_env(), timeout=60, check=True).stdout
    host_help = help_text[help_text.rindex("--host HOST"):].split("--port")[0]  # not the usage
    assert "[127.0.0.1]" in host_help, host_help
    # The running server (started without --host) listens on 127.0.0.1 only.
    addresses = list(listening(server.port))
    assert addresses == ["0100007F"], addresses  # 127.0.0.1, little-endian hex


# ---- (c) request bounds at their edges ----

def test_default_body_limit():
    assert ServerConfig().max_body_bytes == 4 * 1024 * 1024


def test_body_over_the_limit(http):
    big = json.dumps({"prompt": "x" * (5 * 1024 * 1024), "max_tokens": 1}).encode()
    assert_error(http.post("/v1/completions", content=big), 413)


@pytest.mark.parametrize("path,base,field", [
    ("/v1/completions", {"prompt": "Hi"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT}, "max_completion_tokens"),
    ("/generate", {"prompt": "Hi"}, "max_tokens"),
])
def test_max_tokens_over_the_context_is_clamped_to_it(http, path, base, field):
    """Any bound past the context, however large, asks for what the context holds (as
    llama-server does); the reply never outgrows the context."""
    for value in (CTX + 1, 10**30):
        r = http.post(path, json={**base, field: value})
        assert r.status_code == 200, r.text
        if path != "/generate":
            assert r.json()["usage"]["total_tokens"] <= CTX


def test_n_is_bounded(http):
    for path, base in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        assert ServerConfig().max_n == 16
        assert_error(http.post(path, json={**base, "n": 17, "max_tokens": 1}), 400)
        r = http.post(path, json={**base, "n": 16, "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 16


@pytest.mark.parametrize("stop,ok", [
    (["a"] * MAX_STOP_STRINGS, True),
    (["a"] * (MAX_STOP_STRINGS + 1), False),
    ("x" * MAX_STOP_LENGTH, True),
    ("x" * (MAX_STOP_LENGTH + 1), False),
    ([""], False),
])
def test_stop_lists_are_bounded(http, stop, ok):
    for path, base in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": CHAT}),
                       ("/generate", {"prompt": "Hi"})):
        r = http.post(path, json={**base, "stop": stop, "max_tokens": 1})
        if ok:
            assert r.status_code == 200, r.text
        else:
            error = assert_error(r, 400, generate=path == "/generate")
            assert path == "/generate" or error["param"] == "stop", error


# ---- (d) the chat template sandbox ----

def with_chat_template(src: str, dst, template: str) -> None:
    """Copy the GGUF at src to dst with its tokenizer.chat_template replaced in place: the new
    template is padded to the old one's length with a Jinja comment, so no offset moves."""
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        head = f.read(16 * 1024 * 1024)
        key = b"tokenizer.chat_template"
        at = head.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
        kind, length = struct.unpack("<IQ", head[at:at + 12])
        assert kind == 8  # GGUF string
        new = template.encode()
        pad = length - len(new) - len("{##}")
        assert pad >= 0, (length, len(new))
        new += b"{#" + b" " * pad + b"#}"
        f.seek(at + 12)
        f.write(new)


HOSTILE_TEMPLATES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "{% for c in ''.__class__.__base__.__subclasses__() %}{% if c.__name__ == 'Popen' %}"
    "{{ c(['touch', 'MARKER']) }}{% endif %}{% endfor %}",
    "{{ range(10**9) | list }}",
]


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES, ids=range(len(HOSTILE_TEMPLATES)))
def test_hostile_chat_template_is_refused(model_path, tmp_path, template):
    marker = tmp_path / "marker"
    gguf = tmp_path / "hostile.gguf"
    with_chat_template(model_path, gguf, template.replace("MARKER", str(marker)))
    with ServerProcess("--model", str(gguf), "--ctx-size", "512", "--parallel", "1") as srv, \
            srv.http_client(60) as http:
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        error = assert_error(r, 400, type_="invalid_request_error")
        assert error["message"].startswith("chat template error:"), error
        assert not marker.exists()
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"], r.text
        assert http.get("/health").status_code == 200
    assert not marker.exists()
    assert "Traceback" not in srv.log


# Templates that stay inside the sandbox but would take all the CPU time or memory there is.
RESOURCE_HUNGRY_TEMPLATES = {
    "cpu": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "output": "{% for i in range(100000) %}{{ 'x' * 10**7 }}{% endfor %}",
    "memory": "{{ messages | tojson(indent=10**9) }}",
    "one string": "{{ 'x' * 10**11 }}",
}


@pytest.mark.parametrize("template", RESOURCE_HUNGRY_TEMPLATES.values(),
                         ids=RESOURCE_HUNGRY_TEMPLATES.keys())
def test_resource_hungry_chat_template_is_stopped(model_path, tmp_path, template):
    """The render is cut off with a 400; while it runs, streams flow and /health answers."""
    gguf = tmp_path / "hungry.gguf"
    with_chat_template(model_path, gguf, template)
    with ServerProcess("--model", str(gguf), "--parallel", "2", "--template-timeout", "2") as srv, \
            srv.http_client(30) as http:
        with StreamGaps(srv.url) as gaps:
            r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
            assert http.get("/health").status_code == 200
            assert gaps.largest() < 2.0
        error = assert_error(r, 400, type_="invalid_request_error")
        assert error["message"].startswith("chat template error:"), error
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        assert_error(r, 400)  # the next render is refused the same way: its worker was replaced
    assert "Traceback" not in srv.log


# ---- faults: a truncated model file ----

def test_truncated_model_exits_with_one_error_line(model_path, tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as f:
        path.write_bytes(f.read(5 * 1024 * 1024))
    srv = ServerProcess("--model", str(path)).spawn()
    try:
        rc = srv.wait(timeout=30)  # it must exit by itself
    finally:
        srv.kill()
    assert rc == 1  # serve() reports a model that failed to load
    assert "Traceback" not in srv.log
    # The GGUF magic is right, so the server starts and the load fails in the background: one
    # ERROR line from cllm (uvicorn's INFO lines and llama.cpp's own messages aside).
    errors = [line for line in srv.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, srv.stderr
    assert str(path) in errors[0] and "load" in errors[0], errors


# ---- dependencies ----

def test_jinja2_requirement_excludes_versions_with_sandbox_escapes():
    """The chat template sandbox is Jinja's: versions before 3.1.6 let a template escape it
    (CVE-2024-56326, CVE-2025-27516)."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    (jinja,) = [Requirement(r) for r in pyproject["project"]["dependencies"]
                if Requirement(r).name == "jinja2"]
    assert not jinja.specifier.contains("3.1.5") and not jinja.specifier.contains("3.1.4")
    assert jinja.specifier.contains("3.1.6")
