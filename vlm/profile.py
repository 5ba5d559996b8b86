"""What the VLM family's models cost on this device: the family's `profile` hook (`mmspec profile --family vlm`).

The target runs as the loop runs it: per batch size, world questions with their images prefilled (`prefill_vlm`,
one row each), then each timed forward scores W new tokens per row after that prompt, uncommitted. Each drafter
found in the target's folder (`FOLDER/drafters/<kind>`) runs as its tree drafter runs it: the target's prefill
and the drafter's own prompt pass (`begin`: EagleVLM and MSD over every prompt position, ViSpec and SpecVLM over
their compressed image tokens), then W new (token, feature) pairs per row after it. The features are zeros and the
tokens 0: a forward's cost does not depend on their values.

    mmspec profile --family vlm --batch-sizes 1,8,32 --widths 1,2,4,8,16 --threads 2
"""

from __future__ import annotations

from pathlib import Path

from mmspec.lm import GuidedRunner, LMTarget
from mmspec.loop import DecodeState
from mmspec.profile_runners import lm_forward_runner
from mmspec.profiling import RunForward, feature_pairs_step, runner_per_batch
from mmspec.sampling import SamplingParams
from vlm.target import VLMInputs, prefill_vlm


def world_inputs(pipe, batch: int) -> VLMInputs:
    """`batch` held-out world questions with their images, encoded by the pipeline's own processor (right-padded)."""
    from vlm.world import world_vqa_examples

    examples = world_vqa_examples("test", batch, seed=0, long_fraction=1.0)
    return pipe.encode([ex.image for ex in examples], [ex.prompt for ex in examples])


def target_runner(pipe, max_width: int) -> RunForward:
    """`run_forward` of the target (`pipe.lm`) after world prompts (see the module docstring)."""
    return lm_forward_runner(pipe.lm, lambda batch: world_inputs(pipe, batch), None, prefill_vlm, max_width)


def drafter_runner(pipe, drafter, max_width: int) -> RunForward:
    """`run_forward` of a drafter model (attached to `pipe.lm`) after its own prompt pass over world prompts."""
    params = SamplingParams(0.0)

    def start(batch: int) -> GuidedRunner:
        inputs = world_inputs(pipe, batch)
        target = LMTarget(pipe.lm, params, max_width, prefill_fn=prefill_vlm)
        state = DecodeState.new(batch, max_width, pipe.lm.device)
        target.prefill(inputs)  # the features and input embeddings the drafter's begin reads
        loop_drafter = drafter.loop_drafter(drafter, pipe.lm, params)
        loop_drafter.begin(inputs, state)
        return loop_drafter.runner

    return runner_per_batch(start, feature_pairs_step(drafter.hidden_size), max_width)


def profile_runners(pipe, folder: str | Path | None, max_width: int = 64) -> dict:
    """{name: (model, run_forward)}: the target ("target") and each drafter kind saved in `folder`/drafters."""
    from vlm.family import drafter_kinds_in
    from vlm.pipeline import load_drafter

    runners = {"target": (pipe.model, target_runner(pipe, max_width))}
    for kind in drafter_kinds_in(folder) if folder is not None else []:
        drafter = load_drafter(Path(folder) / "drafters" / kind, kind, pipe.model.dtype).to(pipe.lm.device)
        drafter.eval().attach(pipe.lm)
        runners[f"{kind}_drafter"] = (drafter, drafter_runner(pipe, drafter, max_width))
    return runners
