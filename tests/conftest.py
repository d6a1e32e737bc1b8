"""Shared fixtures: the real models, fetched once into the user cache."""
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
    from cllm import _core
    return _core.Model(model_path)


# Options of tests/stress: `pytest --soak` runs its long mode, `--soak-requests N` its size.
def pytest_addoption(parser):
    group = parser.getgroup("cllm stress")
    group.addoption("--soak", action="store_true", default=False,
                    help="run the stress test in soak mode (--soak-requests requests)")
    group.addoption("--soak-requests", type=int, default=10000,
                    help="requests in soak mode [10000]")
