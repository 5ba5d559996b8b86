"""Compile the Triton kernels ahead of time for a CUDA target (sm_90) down to cubins; no GPU needed.

Run as a script in a fresh process without TRITON_INTERPRET (a process that runs kernels in the interpreter
cannot also compile them): `python tests/kernels/aot_compile.py` prints one JSON object, variant name ->
{"ok": bool, "error": str, "ptx": str}. The kernel tests call it through the `gpu_compilation` fixture; it
catches what the interpreter does not check (types of loop-carried values, tl.dot shape rules, constexprs).
"""

from __future__ import annotations

import json
import os
import sys


def _variants():
    from mmspec.kernels.rejection import _rejection_chain_kernel
    from mmspec.kernels.tree_attention import _tree_attention_kernel

    rej_ptr = {"draft_ptr": "*i64", "p_ptr": "*fp32", "q_ptr": "*fp32", "u_ptr": "*fp64", "e_ptr": "*fp64",
               "n_ptr": "*i64", "out_ptr": "*i64", "acc_ptr": "*i64", "flag_ptr": "*u8"}
    for with_q in (False, True):
        consts = {"HAS_Q": with_q, "BLOCK_K": 4, "BLOCK_V": 1024}
        yield f"rejection-q{int(with_q)}", _rejection_chain_kernel, rej_ptr, consts, 8, False
    for dtype, mode in (("bf16", 0), ("bf16", 1), ("bf16", 2), ("fp32", 1)):
        ptr = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "o_ptr": f"*{dtype}",
               "m_ptr": "*u8", "plen_ptr": "*i64", "qk_scale": "fp32"}
        consts = {"MASK_MODE": mode, "DOT_FP32": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_D": 128}
        yield f"tree-{dtype}-mode{mode}", _tree_attention_kernel, ptr, consts, 8, True


def main() -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(triton, "knobs"):  # older tritons take another ASTSource signature form and have no ptxas knob
        print(json.dumps({"_skip": f"the ahead-of-time compile check needs a triton with triton.knobs, found "
                                   f"{triton.__version__}"}))
        return 0
    if not os.path.exists(str(triton.knobs.nvidia.ptxas.path)):
        print(json.dumps({"_skip": "triton's bundled ptxas is missing"}))
        return 0
    results = {}
    for name, kernel, ptr, consts, num_warps, fusion in _variants():
        jitted = kernel.get()
        signature = {n: ptr.get(n, "constexpr" if n in consts else "i32") for n in jitted.arg_names}
        try:
            compiled = triton.compile(
                ASTSource(fn=jitted, signature=signature, constexprs=consts),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": num_warps, "enable_fp_fusion": fusion},
            )
            ok = bool(compiled.asm.get("cubin"))
            results[name] = {"ok": ok, "error": "" if ok else "no cubin", "ptx": compiled.asm["ptx"]}
        except Exception as exc:  # reported to the test, which fails with the message
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "ptx": ""}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
