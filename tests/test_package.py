"""cllm/llama/__init__.py: a checkout runs with the installed copy's native extension."""
import subprocess
import sys
from pathlib import Path

from cllm.llama import _installed_extension_dirs

REPO = Path(__file__).resolve().parent.parent


def test_python_m_from_a_checkout_runs_its_modules_with_the_installed_extension():
    """README's first command, `pip install . && python -m cllm.serve`, is run from the checkout,
    whose `cllm/llama/` comes first on the path and has no `_core` built in it (a plain install
    puts it beside the installed copy): the checkout's modules must still find it."""
    found = subprocess.run(
        [sys.executable, "-c", "import cllm.engine.engine, cllm.llama._core; "
         "print(cllm.engine.engine.__file__); print(cllm.llama.__file__)"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr
    assert len(found.stdout.split()) == 2
    for module_file in found.stdout.split():
        assert Path(module_file).resolve().is_relative_to(REPO)


def test_a_llama_folder_without_the_extension_is_given_the_installed_copys(tmp_path):
    """The folder searched is the installed copy's cllm/llama/, where its `_core` lies; one that
    holds a `_core` of its own searches nowhere else."""
    (installed,) = _installed_extension_dirs(str(tmp_path))
    assert Path(installed).parts[-2:] == ("cllm", "llama")
    assert any(p.name.startswith("_core.") for p in Path(installed).iterdir())
    assert _installed_extension_dirs(installed) == []
