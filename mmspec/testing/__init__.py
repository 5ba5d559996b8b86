"""Small models and helpers for tests and examples: a toy causal transformer target, toy drafters, and
distribution checks for acceptance rules, seeded generators, the lossless rule's tree walk. Nothing here
is needed at inference time."""

import torch


def free_port() -> int:
    """A free local TCP port (a served demo app, torchrun's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_mmspec(arguments: list[str], processes: int = 2, timeout: int = 600):
    """`torchrun --nproc_per_node PROCESSES -m mmspec ARGUMENTS` on a free port, one OpenMP thread a process (gloo on
    the CPU), its output captured: the subprocess's CompletedProcess."""
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                           "--master_port", str(free_port()), "-m", "mmspec", *arguments],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=timeout)


def seeded_generators(n: int, offset: int = 0) -> list[torch.Generator]:
    """One CPU generator per row, seeded offset, offset + 1, ...: row i's randomness does not depend on the batch
    it is generated in, so a row alone (`offset=i`) reproduces that row of a batch."""
    return [torch.Generator().manual_seed(offset + i) for i in range(n)]


def use_sequential_lossless_walk(monkeypatch) -> None:
    """Make the `lossless` rule verify deterministic trees with the tree walk (`walk_tree`, one uniform per child)
    instead of its one-pass form: the same distribution, but the walk draws the numbers the relaxed rules' walk
    draws, so a relaxed rule that moves no mass (GSD with groups of one, LANTERN with delta 0) gives the very same
    tokens. The walk is looked up at call time, so a test may swap `mmspec.verify.lossless.walk_tree` as well.
    `monkeypatch` is pytest's fixture (undone after the test)."""
    from mmspec.verify import lossless

    monkeypatch.setattr(lossless.LosslessRule, "verify_tree", lambda self, tree, target_probs, rand: lossless.walk_tree(
        tree, target_probs, rand, lossless.lossless_node_accept, lossless.lossless_node_reject))
