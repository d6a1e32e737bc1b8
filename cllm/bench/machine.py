"""The machine and the checkout a benchmark ran on, as each report names them: the CPU's
model and the instruction sets that explain CPU results, the GPUs, and the git commit."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

# The instruction sets llama.cpp's CPU kernels pick from: they explain CPU results.
CPU_FLAGS = ("avx2", "avx512f", "amx_tile")


def machine_info() -> dict:
    model, flags = parse_cpu(_output(["lscpu"]) or _read("/proc/cpuinfo"))
    return {"cpu": model or platform.processor() or None, "cpu_flags": flags,
            "nproc": os.cpu_count(), "gpu": _gpu_names(),
            "platform": platform.platform(), "python": platform.python_version()}


def parse_cpu(text: str) -> tuple[str | None, dict[str, bool] | None]:
    """The model name and which CPU_FLAGS are present, from lscpu's output or /proc/cpuinfo
    (both "Key: value" lines; cpuinfo repeats them per core); None for what is not there."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    flags = fields.get("flags")
    return (fields.get("model name") or None,
            None if flags is None else {f: f in flags.split() for f in CPU_FLAGS})


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _gpu_names() -> list[str]:
    out = _output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return [line.strip() for line in out.splitlines() if line.strip()] if out else []


PACKAGE_DIR = Path(__file__).resolve().parent  # cllm/bench


def git_commit(package_dir: Path = PACKAGE_DIR) -> str | None:
    """The commit of the checkout this benchmark runs from; None for an installed copy, even
    one that happens to lie inside some other git repository (a pyenv checkout, say)."""
    top = _output(["git", "rev-parse", "--show-toplevel"], cwd=package_dir)
    if top is None or Path(top.strip()).resolve() / "cllm" / "bench" != package_dir:
        return None
    commit = _output(["git", "rev-parse", "HEAD"], cwd=package_dir)
    dirty = _output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=package_dir)
    return f"{commit.strip()}{'-dirty' if dirty and dirty.strip() else ''}" if commit else None


def _output(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None
