"""Shared fixtures: the real models, fetched once into the user cache, and HTTP clients."""
import pytest

from cllm.models import resolve_model

# The shared HTTP checks are plain asserts: show their operands as in a test module.
pytest.register_assert_rewrite("http_checks")


@pytest.fixture(scope="session")
def model_path() -> str:
    return str(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def gemma_path() -> str:
    return str(resolve_model("gemma3-270m"))


@pytest.fixture(scope="session")
def model(model_path):
    from cllm.llama import _core
    return _core.Model(model_path)


# Options of tests/stress: `pytest --soak` runs its long mode, `--soak-requests N` its size.
def pytest_addoption(parser):
    group = parser.getgroup("cllm stress")
    group.addoption("--soak", action="store_true", default=False,
                    help="run the stress test in soak mode (--soak-requests requests)")
    group.addoption("--soak-requests", type=int, default=10000,
                    help="requests in soak mode [10000]")


# Clients of the module's own `server` fixture (a ServerProcess), for the modules that start one;
# a module may set HTTP_TIMEOUT (seconds, default 120) for slow requests.
@pytest.fixture(scope="module")
def http(request, server):
    with server.http_client(_timeout(request)) as client:
        yield client


@pytest.fixture(scope="module")
def client(request, server):
    with server.openai_client(_timeout(request)) as c:
        yield c


def _timeout(request) -> float:
    return getattr(request.module, "HTTP_TIMEOUT", 120)
