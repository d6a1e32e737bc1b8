"""llama-server as the peer to compare with: built from the pinned llama.cpp tree cllm uses.

Nothing of llama.cpp is committed: the tree is the one `pip install .` unpacked into the cache
(or $CLLM_LLAMA_SOURCE). The build lives beside it, keyed by the tree and the extra CMake
arguments in $CMAKE_ARGS, so a CUDA build and a CPU build do not overwrite each other."""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from cllm.models import cache_dir

from .servers import ServerSettings, StartedServer, say, start_process

# Read from vendor/llama_cpp.cmake so the pin is written down once.
_PIN_FILE = Path(__file__).resolve().parents[2] / "vendor" / "llama_cpp.cmake"
_FALLBACK_COMMIT = "0c1e57098"

# The pinned sdist leaves out llama.cpp's scripts/, yet tools/ui runs scripts/ui-assets.cmake
# to generate ui.h/ui.cpp. This stand-in generates them with no assets (no web UI): the server
# then serves only its API, which is all a benchmark needs.
_UI_ASSETS_STUB = Path(__file__).with_name("ui-assets-stub.cmake")

_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_APP=OFF",
    # The web UI would need npm or a download; the API needs neither.
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
)


def pinned_commit() -> str:
    try:
        match = re.search(r'CLLM_LLAMA_COMMIT "(\w+)"', _PIN_FILE.read_text())
    except OSError:
        match = None
    return match.group(1) if match else _FALLBACK_COMMIT


def source_tree() -> Path:
    """$CLLM_LLAMA_SOURCE if it is a directory, else the tree `pip install .` left in the cache."""
    env = os.environ.get("CLLM_LLAMA_SOURCE")
    tree = Path(env).expanduser() if env else cache_dir() / f"llama.cpp-{pinned_commit()}"
    if not (tree / "CMakeLists.txt").is_file() or not (tree / "tools" / "server").is_dir():
        raise SystemExit(f"no llama.cpp source tree with tools/server at {tree}: run `pip install .` "
                         "first (it unpacks the pinned tree into the cache), or point "
                         "CLLM_LLAMA_SOURCE at a llama.cpp directory")
    return tree


def build_dir(tree: Path, extra_args: list[str]) -> Path:
    """One build directory per source tree and set of extra CMake arguments (a CMake build
    directory belongs to one source tree); a -cuda suffix makes a CUDA build easy to spot."""
    name = "llama-server-build"
    if any(a.upper().replace(" ", "") in ("-DGGML_CUDA=ON", "-DGGML_CUDA=1") for a in extra_args):
        name += "-cuda"
    key = "\0".join([str(tree.resolve()), *extra_args])
    return cache_dir() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def _source_with_ui_stub(tree: Path) -> Path:
    """The tree itself if it has scripts/ui-assets.cmake, else a mirror of symlinks plus the stub."""
    if (tree / "scripts" / "ui-assets.cmake").is_file():
        return tree
    mirror = cache_dir() / f"llama-server-src-{hashlib.sha256(str(tree).encode()).hexdigest()[:8]}"
    (mirror / "scripts").mkdir(parents=True, exist_ok=True)
    for entry in tree.iterdir():
        link = mirror / entry.name
        if entry.name != "scripts" and not link.is_symlink():
            link.symlink_to(entry)
    stub = mirror / "scripts" / "ui-assets.cmake"
    if not stub.is_file() or stub.read_text() != _UI_ASSETS_STUB.read_text():
        stub.write_text(_UI_ASSETS_STUB.read_text())
    return mirror


def _newest_mtime(tree: Path) -> float:
    """When the tree was last unpacked: the top-level file and directories get the unpack time."""
    newest = (tree / "CMakeLists.txt").stat().st_mtime
    for part in ("src", "ggml", "common", "tools/server", "include"):
        newest = max(newest, (tree / part).stat().st_mtime)
    return newest


def build(targets: tuple[str, ...] = ("llama-server",)) -> dict[str, Path]:
    """Configures and builds `targets` unless each binary exists and is newer than the tree."""
    prebuilt = os.environ.get("CLLM_PEER_BIN")  # e.g. cllm's own build with -DCLLM_BUILD_PEER=ON
    if prebuilt:
        return {t: Path(prebuilt) / t for t in targets}
    tree = source_tree()
    extra = shlex.split(os.environ.get("CMAKE_ARGS", ""))
    out = build_dir(tree, extra)
    binaries = {t: out / "bin" / t for t in targets}
    if all(b.is_file() and b.stat().st_mtime > _newest_mtime(tree) for b in binaries.values()):
        return binaries
    jobs = os.cpu_count() or 2
    started = time.monotonic()
    say(f"building {', '.join(targets)} from {tree} into {out} (-j{jobs}); this takes minutes")
    source = _source_with_ui_stub(tree)
    _run(["cmake", "-S", str(source), "-B", str(out), "-G", "Ninja", *_CMAKE_FLAGS, *extra])
    _run(["cmake", "--build", str(out), "--target", *targets, "-j", str(jobs)])
    say(f"built in {time.monotonic() - started:.0f} s")
    return binaries


def _run(cmd: list[str]) -> None:
    say("$ " + shlex.join(cmd))
    if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
        raise SystemExit(f"command failed: {shlex.join(cmd)}")


def server_command(binary: Path, model: Path, port: int, s: ServerSettings) -> list[str]:
    """llama-server flags equivalent to cllm's. Both take the context size as the total over all
    sequences: split evenly among them, or one pool that any of them may fill (--kv-unified,
    for llama-server only where `peer_kv_unified` asks)."""
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(s.parallel), "-c", str(s.ctx_size),
            *(["--kv-unified"] if s.peer_kv_unified else []),
            "-t", str(s.threads), "-b", str(s.batch_size), "-ub", str(s.ubatch_size),
            # cllm's -1 is llama.h's "every layer"; llama-server's -1 would mean "auto" (fit).
            "-fa", s.flash_attn, "-ngl", "all" if s.n_gpu_layers < 0 else str(s.n_gpu_layers),
            "--no-webui",
            # llama.cpp's AMX/repack buffers crash where the CPU reports AMX under a VM;
            # cllm turns them off the same way (use_extra_bufts=false).
            "--no-repack", *s.peer_args]


def start_peer(model: Path, s: ServerSettings, log_dir: Path,
               name: str = "llama-server") -> StartedServer:
    binary = build()["llama-server"]
    return start_process(name, lambda port: server_command(binary, model, port, s), log_dir)


if __name__ == "__main__":
    # `python -m cllm.bench.peer [--batched-bench]`: build only.
    wanted = ("llama-server", "llama-batched-bench") if "--batched-bench" in sys.argv else (
        "llama-server",)
    for path in build(wanted).values():
        print(path)
