"""Options of the stress test: `--soak` runs the long mode, `--soak-requests N` its size."""
import sys
from pathlib import Path

# server_process.py lives one level up (tests/), which pytest does not put on the path for us.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pytest_addoption(parser):
    group = parser.getgroup("cllm stress")
    group.addoption("--soak", action="store_true", default=False,
                    help="run the stress test in soak mode (--soak-requests requests)")
    group.addoption("--soak-requests", type=int, default=10000,
                    help="requests in soak mode [10000]")
