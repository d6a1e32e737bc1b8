"""cllm/__init__.py: a checkout runs with the installed copy's native extension."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_python_m_from_a_checkout_runs_its_modules_with_the_installed_extension():
    """README's first command, `pip install . && python -m cllm.serve`, is run from the checkout,
    whose `cllm/` comes first on the path and has no `_core` built in it (a plain install puts
    it beside the installed copy): the checkout's modules must still find it."""
    found = subprocess.run(
        [sys.executable, "-c", "import cllm.engine; print(cllm.engine.__file__)"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()).resolve().is_relative_to(REPO)
