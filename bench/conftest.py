"""The micro-benchmarks reuse the tests' real-server helper."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
