"""The machine and the checkout a report names."""
import subprocess
from pathlib import Path

from cllm.bench import machine


def test_the_commit_is_this_checkouts_and_none_for_a_copy_inside_another_repository(tmp_path):
    checkout = Path(__file__).resolve().parents[2]  # this test's repository, not the install
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=checkout, check=True).stdout.strip()
    assert machine.git_commit(checkout / "cllm" / "bench").removesuffix("-dirty") == head
    copy = tmp_path / "lib" / "site-packages" / "cllm" / "bench"  # e.g. under a pyenv checkout
    copy.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert machine.git_commit(copy) is None


_LSCPU = """Architecture:            x86_64
CPU(s):                  2
Model name:              Intel(R) Xeon(R) Platinum 8480+
Flags:                   fpu sse2 avx2 avx512f amx_bf16 amx_tile
"""
_CPUINFO = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx2
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx2
"""


def test_cpu_model_and_flags():
    assert machine.parse_cpu(_LSCPU) == ("Intel(R) Xeon(R) Platinum 8480+",
                                        {"avx2": True, "avx512f": True, "amx_tile": True})
    assert machine.parse_cpu(_CPUINFO) == ("AMD EPYC 7B13",
                                          {"avx2": True, "avx512f": False, "amx_tile": False})
    assert machine.parse_cpu("") == (None, None)
