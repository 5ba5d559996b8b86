"""The VLM drafters (budget auto and fixed) and mmspec's vanilla loop against transformers' own greedy `generate`
on the same world LLaVA, batch 1, 16 held-out long-answer questions, in one process with interleaved passes (one
warm-up, two recorded): prints each configuration's median seconds per pass, its ratio to `generate` and whether
its tokens equal `generate`'s (2026-11-24, 2 threads: SpecVLM's auto budget 1.51x of `generate`, EagleVLM's 1.47x).

    python -m vlm.compare_generate            # about 3 minutes on 2 CPU cores
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from vlm.family import DRAFTER_KINDS
from vlm.pipeline import SpeculativeVLM, load_drafter
from vlm.world import world_vqa_examples

MAX_NEW_TOKENS = 96


def transformers_answer(vlm: SpeculativeVLM, example) -> list[int]:
    """transformers' greedy `generate` on one question: the new tokens (EOS included)."""
    tok = vlm.processor.tokenizer
    inputs = vlm.encode([example.image], [example.prompt])
    with torch.no_grad():
        out = vlm.model.generate(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                                 pixel_values=inputs.pixel_values, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return out[0, inputs.input_ids.shape[1]:].tolist()


def configurations(folder: str = "assets/vlm") -> dict[str, Callable]:
    """name -> answer(example): transformers' generate, mmspec vanilla, every drafter with budget auto and fixed."""
    base = SpeculativeVLM.from_pretrained(folder)

    def ours(vlm: SpeculativeVLM, **kwargs) -> Callable:
        return lambda ex: vlm.generate([ex.image], [ex.prompt], MAX_NEW_TOKENS, batch_size=1, **kwargs).token_ids[0]

    runs = {"transformers": lambda ex: transformers_answer(base, ex), "vanilla": ours(base, use_drafter=False)}
    for kind in DRAFTER_KINDS:
        vlm = SpeculativeVLM(base.model, base.processor, load_drafter(f"{folder}/drafters/{kind}", kind))
        runs[f"{kind}:auto"] = ours(vlm)
        runs[f"{kind}:fixed"] = ours(vlm, budget="fixed")
    return runs


def main(threads: int = 2, samples: int = 16, passes: int = 3) -> None:
    torch.set_num_threads(threads)
    examples = world_vqa_examples("test", samples, seed=0, long_fraction=1.0)
    runs = configurations()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    same = dict.fromkeys(runs, True)
    reference: list[list[int]] = []
    for rep in range(passes):  # the first pass warms up
        for name, answer in runs.items():
            start = time.perf_counter()
            answers = [answer(ex) for ex in examples]
            if rep > 0:
                seconds[name].append(time.perf_counter() - start)
            if name == "transformers":
                reference = answers
            else:  # transformers may stop one token later (it keeps EOS the same way; compare the common part)
                same[name] &= all(a[:len(b)] == b[:len(a)] for a, b in zip(answers, reference))
    base = statistics.median(seconds["transformers"])
    for name in runs:
        median = statistics.median(seconds[name])
        print(f"{name:16s} {median:7.2f} s  {base / median:.2f}x transformers' generate  same tokens: {same[name]}")


if __name__ == "__main__":
    main()
