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

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

_REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


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
