"""Test-wide setup.

- Triton kernels run on CPU under its interpreter, which must be switched on before `triton` is first imported
  (triton 3.9 fixes interpreted vs compiled builtins at import time, and torch.compile may import triton early).
  On a machine with CUDA the real kernels are used instead.
- Measured costs (`mmspec.cost`, draft budgets) are cached in a fresh temporary folder, not the user's cache, and
  are quick profiles (`MMSPEC_PROFILE_REPEATS=2`: two timed repeats after one warm-up call): no test asserts what
  a budget chooses from real timings, and full profiles of the real models took 144 s of the suite.
- One torch thread: the tests run tiny models, where thread start-up costs more than it saves, and on a shared
  2-core machine two OpenMP threads per process can stall each other by 10x.
"""

import os
import tempfile

import torch

os.environ.setdefault("MMSPEC_CACHE", tempfile.mkdtemp(prefix="mmspec-test-cache-"))
os.environ.setdefault("MMSPEC_PROFILE_REPEATS", "2")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)


def pytest_terminal_summary(terminalreporter) -> None:
    """One line counting what the method contract (tests/test_contract.py) checked, per (family, method) pair."""
    passed = [r.nodeid for r in terminalreporter.stats.get("passed", []) if "test_contract.py::" in r.nodeid]
    pairs = {n.split("[", 1)[1][:-1] for n in passed if "test_exact_settings_give_vanillas_tokens[" in n}
    if pairs:
        terminalreporter.write_line(f"method contract: {len(passed)} checks passed over {len(pairs)} (family, method) "
                                    f"pairs")
