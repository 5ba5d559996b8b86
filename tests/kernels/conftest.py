"""Fixtures for the kernel and attention-backend tests.

The Triton kernels run on CPU tensors in Triton's interpreter. Triton reads `TRITON_INTERPRET` when it is
first imported (its `tl.max`, `tl.sum`, ... are set up then), so the variable is set here at import time,
before any test of this folder imports triton. If something imported triton earlier in the session without
it, the launchers raise an InputError saying so; the fix is to set the variable in the shell or in the root
`tests/conftest.py`. The autouse fixture keeps it set for every test of this folder (a test may delete it
to check the error raised without the interpreter).

`masks` gives the mask builders the tests share: causal, ragged (a static KV cache with per-row lengths) and
tree (committed prefix + ancestors in a small draft tree). `gpu_compilation` compiles every kernel variant
ahead of time for a CUDA target down to a cubin, in a subprocess without the interpreter; no GPU is needed.

On a machine with a GPU the same tests run the compiled kernels instead: `MMSPEC_KERNEL_TESTS_DEVICE=cuda
python -m pytest tests/kernels`. Then the interpreter stays off, and every launcher a test module imports
(`rejection_sample_chain`, `tree_attention`, `tree_attention_structured`) is wrapped to move its tensor
arguments to the GPU and its results back, so each test compares the compiled kernel with the CPU twin on
the test's own inputs. Tests marked `interpreter_only` (they check the interpreter's own error) are skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch  # does not import triton

ON_CUDA = os.environ.get("MMSPEC_KERNEL_TESTS_DEVICE", "").strip().lower() == "cuda"
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

_REPO = Path(__file__).resolve().parents[2]
_LAUNCHERS = ("rejection_sample_chain", "tree_attention", "tree_attention_structured")


def _on_cuda(launcher):
    """launcher with its tensor arguments moved to the GPU and its tensor results moved back to the CPU."""
    def move(a):
        return a.cuda() if isinstance(a, torch.Tensor) else a

    def run(*args, **kwargs):
        out = launcher(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
        return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()

    return run


@pytest.fixture(autouse=True)
def _triton_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        return
    if not torch.cuda.is_available():
        pytest.fail("MMSPEC_KERNEL_TESTS_DEVICE=cuda is set but torch sees no CUDA device.")
    if request.node.get_closest_marker("interpreter_only"):
        pytest.skip("checks the interpreter's CPU path (kernel tests run on CUDA here)")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name in _LAUNCHERS:
        if hasattr(request.module, name):
            monkeypatch.setattr(request.module, name, _on_cuda(getattr(request.module, name)))


def causal_mask(batch: int, s: int, t: int) -> torch.Tensor:
    """Queries are the last S of T positions; query i sees keys <= T - S + i. -> [B, S, T] bool."""
    q_pos = torch.arange(s) + (t - s)  # [S]
    return (torch.arange(t)[None, :] <= q_pos[:, None]).expand(batch, s, t).clone()


def ragged_mask(lengths: list[int], s: int, t: int, valid_queries: list[int] | None = None) -> torch.Tensor:
    """Static cache of capacity T; row b holds lengths[b] keys whose last S are this forward's queries.

    Query i of row b sits at position lengths[b] - S + i and sees the keys up to it; keys past lengths[b]
    are empty cache slots. Queries >= valid_queries[b] are padding (fully masked). -> [B, S, T] bool.
    """
    rows = []
    for b, length in enumerate(lengths):
        q_pos = torch.arange(s) + (length - s)  # [S]
        m = torch.arange(t)[None, :] <= q_pos[:, None]  # [S, T]
        if valid_queries is not None:
            m[valid_queries[b]:] = False
        rows.append(m)
    return torch.stack(rows)


def ancestors(parents: list[int]) -> torch.Tensor:
    """parents[i] < i (parents[0] = -1) -> [S, S] bool, True where j is i or an ancestor of i."""
    s = len(parents)
    anc = torch.zeros(s, s, dtype=torch.bool)
    for i, par in enumerate(parents):
        anc[i, i] = True
        if par >= 0:
            anc[i] |= anc[par]
    return anc


def tree_mask(prefix: list[int], parents: list[int], t: int) -> torch.Tensor:
    """Row b: the committed prefix of prefix[b] keys is visible to every node; node i (key prefix[b] + i)
    also sees its ancestors and itself. -> [B, S, T] bool with S = len(parents).
    """
    s = len(parents)
    anc = ancestors(parents)
    rows = []
    for p in prefix:
        m = torch.zeros(s, t, dtype=torch.bool)
        m[:, :p] = True
        m[:, p:p + s] = anc[:, : max(0, min(s, t - p))]
        rows.append(m)
    return torch.stack(rows)


# 7 nodes: the root, two children, three grandchildren, one great-grandchild
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3]


@pytest.fixture
def kernel_device() -> str:
    """Where a test that calls a kernel indirectly (not through a wrapped launcher) puts its tensors."""
    return "cuda" if ON_CUDA else "cpu"


@pytest.fixture
def masks() -> SimpleNamespace:
    return SimpleNamespace(causal=causal_mask, ragged=ragged_mask, tree=tree_mask, ancestors=ancestors,
                           tree_parents=TREE_PARENTS)



@pytest.fixture(scope="session")
def gpu_compilation() -> dict[str, dict[str, object]]:
    """Compile every kernel variant for sm_90 in a fresh process (see aot_compile.py), once per session."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("aot_compile.py"))], env=env,
                          capture_output=True, text=True, timeout=300, cwd=_REPO)
    if proc.returncode != 0:
        pytest.fail(f"aot_compile.py failed:\n{proc.stderr[-4000:]}")
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    if "_skip" in results:
        pytest.skip(results["_skip"])
    return results
