"""Shared fixtures: the real models, fetched once into the user cache."""
import pytest

from cllm.models import resolve_model


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
