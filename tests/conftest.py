"""Test-wide setup.

Triton kernels run on CPU under its interpreter, which must be switched on before `triton` is first imported
(triton 3.9 fixes interpreted vs compiled builtins at import time, and torch.compile may import triton early).
On a machine with CUDA the real kernels are used instead.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
