"""The stress test imports tests/server_process.py."""
import sys
from pathlib import Path

# server_process.py lives one level up (tests/), which pytest does not put on the path for us.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
