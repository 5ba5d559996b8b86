"""`LlamaGenPipeline`: class- (or caption-) conditional image generation with LlamaGen, any decoding method.

    pipe = LlamaGenPipeline.from_pretrained("assets/llamagen")
    out = pipe(class_labels=[0, 5], guidance_scale=4.0, generator=torch.Generator().manual_seed(0))
    out.images      # PIL images;  out.stats: the SpecStats of the run (NFE, acceptance, wall time)

The transformer generates `block_size` VQ tokens in raster order through the shared draft-verify loop
(`mmspec.loop.generate`); classifier-free guidance runs the conditional and unconditional halves as one batch of
2B rows fed the same sampled token (LlamaGen's way). The VQ decoder turns the tokens into images. `method=`
picks the decoding method, e.g. "vanilla", "sjd" or "eagle" (declared in `image_ar.llamagen.family`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers import DiffusionPipeline

from image_ar.llamagen.family import FAMILY
from image_ar.llamagen.gpt import LlamaGenGPT
from image_ar.llamagen.methods import MethodContext
from image_ar.llamagen.vq import LlamaGenVQ
from mmspec.budget import make_budget
from mmspec.diffusers_folder import MMSpecPipelineMixin
from mmspec.errors import check
from mmspec.loop import generate
from mmspec.pipeline_io import (
    GenerationOutput,
    check_generators,
    check_output_type,
    class_run_fields,
    finish_generation,
)
from mmspec.sampling import SamplingParams

LlamaGenPipelineOutput = GenerationOutput  # images, tokens [N, block_size], stats (the run's SpecStats)


def condition_prefill(guided: bool, cond_mask: torch.Tensor | None = None):
    """The prefill a LlamaGen model needs in the loop: embed the condition (and the null condition for CFG as
    the second half of the batch), run it, return (cache, logits for the first image token [R, 1, V])."""

    def prefill(model: LlamaGenGPT, cond: torch.Tensor, extra_capacity: int):
        rows = cond.shape[0]
        emb = model.embed_condition(cond)  # [B, C, dim]
        mask = cond_mask
        if guided:
            null = model.embed_condition(cond, drop_mask=torch.ones(rows, dtype=torch.bool, device=cond.device))
            emb = torch.cat([emb, null], dim=0)  # [2B, C, dim]
            mask = None if cond_mask is None else torch.cat([cond_mask, cond_mask], dim=0)
        cache = model.new_cache(emb.shape[0], model.config.cls_token_num + extra_capacity)
        logits = model.prefill_condition(emb, cache, cond_mask=mask)  # [R, V]
        return cache, logits.unsqueeze(1)

    return prefill


class LlamaGenPipeline(MMSpecPipelineMixin, DiffusionPipeline):
    """LlamaGen target + VQ tokenizer, and optional drafters: a small draft LlamaGen (method draft-model) and an
    EAGLE drafter over the target's features (methods eagle, lantern)."""

    model_cpu_offload_seq = "transformer->vqvae"
    _optional_components = ["draft_transformer", "eagle_drafter"]

    def __init__(self, transformer: LlamaGenGPT, vqvae: LlamaGenVQ, draft_transformer: LlamaGenGPT | None = None,
                 eagle_drafter: Any = None):
        super().__init__()
        self.register_modules(transformer=transformer, vqvae=vqvae, draft_transformer=draft_transformer,
                              eagle_drafter=eagle_drafter)
        self.lantern_tables: dict[int, torch.Tensor] = {}  # LANTERN's neighbour tables of the VQ codebook, per k
        self.budgets: dict = {}  # budget="auto" on tree drafters: what each budget learnt, kept between calls

    def compile_forwards(self, mode: str | None = "default") -> LlamaGenPipeline:
        """`torch.compile` the step forwards of the transformer and of the drafters present
        (`mmspec.compile.compile_cached_lm`; "reduce-overhead" adds CUDA graphs on a GPU); `mode=None` undoes it.
        The first image of each batch size and method pays the compilation (seconds to a minute)."""
        from mmspec.compile import compile_cached_lm, uncompile_cached_lm

        for model in (self.transformer, self.draft_transformer, self.eagle_drafter):
            if model is None:
                continue
            if mode is None:
                uncompile_cached_lm(model)
            else:
                compile_cached_lm(model, mode)
        return self

    # ----------------------------------------------------------------------------------------- inputs
    def _conditions(self, class_labels, prompt_embeds, num_images_per_prompt: int, generator,
                    output_type: str) -> torch.Tensor:
        """The checked conditions [N] (class ids) or [N, cls_token_num, caption_dim] (caption features)."""
        model = self.transformer
        device = model.device
        if model.config.model_type == "c2i":
            check(prompt_embeds is None,
                  "this is a class-conditional (c2i) model: pass class_labels, not prompt_embeds.")
            return class_run_fields(class_labels, num_images_per_prompt, model.config.num_classes, generator,
                                    output_type, guided=False, device=device)["labels"]
        check_output_type(output_type)
        check(isinstance(num_images_per_prompt, int) and num_images_per_prompt >= 1,
              f"num_images_per_prompt must be an integer >= 1, got {num_images_per_prompt!r}.")
        check(class_labels is None, "this is a text-conditional (t2i) model: pass prompt_embeds, not class_labels.")
        check(isinstance(prompt_embeds, torch.Tensor) and prompt_embeds.dim() == 3,
              "prompt_embeds must be [B, cls_token_num, caption_dim] caption features (e.g. flan-t5-xl).")
        cond = prompt_embeds.repeat_interleave(num_images_per_prompt, dim=0).to(device)
        check_generators(generator, cond.shape[0])
        return cond

    # ------------------------------------------------------------------------------------------- call
    @torch.no_grad()
    def __call__(self, class_labels: int | list[int] | torch.Tensor | None = None,
                 prompt_embeds: torch.Tensor | None = None, prompt_embeds_mask: torch.Tensor | None = None,
                 guidance_scale: float = 4.0, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 num_images_per_prompt: int = 1, generator: torch.Generator | list[torch.Generator] | None = None,
                 method: str = "vanilla", method_kwargs: dict[str, Any] | None = None, budget: str | None = "fixed",
                 output_type: str = "pil", return_dict: bool = True,
                 callback_on_step_end: Callable[[Any, int, int, dict], Any] | None = None,
                 callback_on_step_end_tensor_inputs: list[str] | None = None):
        """Generate images.

        guidance_scale: CFG scale (1.0 disables the unconditional half). temperature 0 = greedy; top_k 0 and
        top_p 1.0 disable those filters. generator: one, or one per image (then each image is independent of
        the batch it was generated in). callback_on_step_end(pipe, step, num_tokens, {"tokens": [N, T]}) runs
        after every loop iteration (read-only; a function or a diffusers `PipelineCallback`; setting
        `pipe._interrupt = True` or returning {"stop": True} ends the call early, e.g. a UI's cancel button).
        budget: "fixed" (default) drafts the method's configured size every step; "auto" (experimental) lets
        `mmspec.budget` pick each step's draft size (0 = a plain step) from this device's measured step costs and the
        acceptance seen so far (chain and Jacobi drafters; the first call per model, device and batch size measures
        the costs, then they are cached).
        """
        check(isinstance(guidance_scale, (int, float)), f"guidance_scale must be a number, got {guidance_scale!r}.")
        user_step = self.step_callback(callback_on_step_end, callback_on_step_end_tensor_inputs,
                                       self.transformer.config.block_size)
        params = SamplingParams(temperature, top_k, top_p)
        cond = self._conditions(class_labels, prompt_embeds, num_images_per_prompt, generator, output_type)
        batch = cond.shape[0]
        guided = guidance_scale != 1.0
        cond_mask = None
        if prompt_embeds_mask is not None:
            cond_mask = prompt_embeds_mask.bool().repeat_interleave(num_images_per_prompt, dim=0).to(cond.device)
        ctx = MethodContext(self, params, guidance_scale if guided else None, condition_prefill(guided, cond_mask),
                            generator, batch)
        drafter, rule = FAMILY.get_method(method).build(ctx, method_kwargs, "LlamaGen")

        from mmspec.lm import DRAFT_ROOM, LMTarget  # the target: the transformer with CFG, under the sampling params

        block = self.transformer.config.block_size
        # room for the largest verify: a tree drafter says its node budget; chains and windows fit in DRAFT_ROOM
        draft_room = max(DRAFT_ROOM, getattr(drafter, "max_draft_nodes", 0))
        target = LMTarget(self.transformer, params, max_new_tokens=block, max_draft_nodes=draft_room,
                          guidance_scale=ctx.guidance_scale, prefill_fn=ctx.prefill_fn)
        for model in (self.transformer, self.draft_transformer):  # positions are bounded here; no per-call sync
            if model is not None:
                model.check_positions = False
        draft_budget = make_budget(budget, target, drafter, rule, cond, batch, cond.device, self.budgets)

        with self.progress_bar(total=block) as bar:
            def on_step(state, draft, result):
                done = int(state.num_generated.min())
                bar.update(done - bar.n)
                return user_step(state.iteration - 1, done, {"tokens": state.tokens})

            gen = generate(target, drafter, rule, cond, batch_size=batch, max_new_tokens=block, generator=generator,
                           device=cond.device, callback=on_step, budget=draft_budget)
            bar.update(block - bar.n)

        tokens = gen.tokens  # [N, block]
        if output_type != "latent":
            check(bool((tokens >= 0).all()), "generation stopped early; no image to decode (use output_type='latent').")
        return finish_generation(self, tokens, lambda: (self.vqvae.decode_code(tokens) + 1) / 2, output_type,
                                 return_dict, gen.stats)
