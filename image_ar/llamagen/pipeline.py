"""`LlamaGenPipeline`: class- (or caption-) conditional image generation with LlamaGen, any decoding method.

    pipe = LlamaGenPipeline.from_pretrained("assets/llamagen")
    out = pipe(class_labels=[0, 5], guidance_scale=4.0, generator=torch.Generator().manual_seed(0))
    out.images      # PIL images;  out.stats: the SpecStats of the run (NFE, acceptance, wall time)

    t2i = LlamaGenPipeline.from_pretrained(folder)        # with a text_encoder (T5) and its tokenizer
    t2i("a small red circle in the center on a black background", method="sjd").images[0]

The transformer generates `block_size` VQ tokens in raster order through the shared draft-verify loop
(`mmspec.loop.generate`); classifier-free guidance runs the conditional and unconditional halves as one batch of
2B rows fed the same sampled token (LlamaGen's way). The VQ decoder turns the tokens into images. `method=`
picks the decoding method, e.g. "vanilla", "sjd" or "eagle" (declared in `image_ar.llamagen.family`).

A text-conditional (t2i) pipeline holds the caption encoder as two components, `text_encoder` (a transformers
`T5EncoderModel`) and `tokenizer`, and turns `prompt` strings into the caption features the GPT reads exactly as
the official sampling script does (`image_ar.llamagen.text`: cleaning, padding to cls_token_num, left-padding);
`prompt_embeds` + `prompt_embeds_mask` (already left-padded) stay the advanced path, `encode_prompt` gives them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers import DiffusionPipeline

from image_ar.llamagen.family import FAMILY
from image_ar.llamagen.gpt import LlamaGenGPT
from image_ar.llamagen.methods import MethodContext
from image_ar.llamagen.rope import grid_size_of
from image_ar.llamagen.text import caption_condition, check_prompts, tokenize_captions
from image_ar.llamagen.vq import LlamaGenVQ
from mmspec.budget import make_budget
from mmspec.diffusers_folder import MMSpecPipelineMixin
from mmspec.errors import check
from mmspec.loop import generate
from mmspec.pipeline_io import (
    GenerationOutput,
    check_generators,
    check_no_inference_steps,
    check_output_type,
    class_run_fields,
    finish_generation,
)
from mmspec.sampling import SamplingParams

DEFAULT_GUIDANCE = 4.0  # the official c2i sampling script's cfg-scale, when a model's config names none
LlamaGenPipelineOutput = GenerationOutput  # images, tokens [N, block_size], stats (the run's SpecStats)


def condition_prefill(guided: bool, cond_mask: torch.Tensor | None = None, negative: torch.Tensor | None = None,
                      negative_mask: torch.Tensor | None = None):
    """The prefill a LlamaGen model needs in the loop: embed the condition (and the null condition for CFG as
    the second half of the batch), run it, return (cache, logits for the first image token [R, 1, V]).
    cond_mask [B, C] bool: the caption tokens (t2i). The null rows are the null class / the learned unconditional
    caption under the caption's own mask (official), or, given, a negative caption [B, C, D] with its own mask."""

    def prefill(model: LlamaGenGPT, cond: torch.Tensor, extra_capacity: int):
        rows = cond.shape[0]
        emb = model.embed_condition(cond)  # [B, C, dim]
        mask = cond_mask
        if guided:
            if negative is None:
                null = model.embed_condition(cond, drop_mask=torch.ones(rows, dtype=torch.bool, device=cond.device))
                null_mask = cond_mask
            else:
                null, null_mask = model.embed_condition(negative), negative_mask
            emb = torch.cat([emb, null], dim=0)  # [2B, C, dim]
            if mask is not None or null_mask is not None:
                every = torch.ones(cond.shape[:2], dtype=torch.bool, device=cond.device)  # [B, C]
                mask = torch.cat([every if mask is None else mask, every if null_mask is None else null_mask])
        cache = model.new_cache(emb.shape[0], model.config.cls_token_num + extra_capacity)
        logits = model.prefill_condition(emb, cache, cond_mask=mask)  # [R, V]
        return cache, logits.unsqueeze(1)

    return prefill


def is_caption_list(value: Any) -> bool:
    """Whether a first argument is a caption or a list of captions (not class labels)."""
    return isinstance(value, str) or (isinstance(value, (list, tuple)) and len(value) > 0
                                      and all(isinstance(v, str) for v in value))


def per_image(rows: torch.Tensor | None, num_images_per_prompt: int, cond: torch.Tensor,
              name: str) -> torch.Tensor | None:
    """Per-caption rows (a mask [B, C] or features [B, C, D]; one row broadcasts to every caption) -> one per
    image [N, ...] on cond's device (masks as bool)."""
    if rows is None:
        return None
    n = cond.shape[0] // num_images_per_prompt
    check(isinstance(rows, torch.Tensor) and rows.shape[0] in (1, n),
          f"{name} must have one row or one per caption ({n}), got {list(getattr(rows, 'shape', []))}.")
    rows = rows.expand(n, *rows.shape[1:]) if rows.shape[0] == 1 else rows
    rows = rows.bool() if rows.dim() == 2 else rows.to(cond.dtype)
    return rows.repeat_interleave(num_images_per_prompt, dim=0).to(cond.device)


class LlamaGenPipeline(MMSpecPipelineMixin, DiffusionPipeline):
    """LlamaGen target + VQ tokenizer, and optional drafters: a small draft LlamaGen (method draft-model) and an
    EAGLE drafter over the target's features (methods eagle, lantern)."""

    model_cpu_offload_seq = "text_encoder->transformer->vqvae"
    _optional_components = ["draft_transformer", "eagle_drafter", "text_encoder", "tokenizer"]

    def __init__(self, transformer: LlamaGenGPT, vqvae: LlamaGenVQ, draft_transformer: LlamaGenGPT | None = None,
                 eagle_drafter: Any = None, text_encoder: Any = None, tokenizer: Any = None,
                 clean_caption: bool = True):
        super().__init__()
        check((text_encoder is None) == (tokenizer is None),
              "a text_encoder needs its tokenizer (and a tokenizer its text_encoder): pass both or neither.")
        if text_encoder is not None:
            check(transformer.config.model_type == "t2i", "a text_encoder belongs to a t2i model; this transformer "
                                                          "is class-conditional (c2i): drop text_encoder/tokenizer.")
            width = getattr(text_encoder.config, "d_model", getattr(text_encoder.config, "hidden_size", None))
            check(width == transformer.config.caption_dim,
                  f"the text_encoder's width {width} differs from the transformer's caption_dim "
                  f"{transformer.config.caption_dim}; use the encoder the model was trained with.")
        self.register_modules(transformer=transformer, vqvae=vqvae, draft_transformer=draft_transformer,
                              eagle_drafter=eagle_drafter, text_encoder=text_encoder, tokenizer=tokenizer)
        self.register_to_config(clean_caption=bool(clean_caption))
        self.lantern_tables: dict[int, torch.Tensor] = {}  # LANTERN's neighbour tables of the VQ codebook, per k
        self.budgets: dict = {}  # budget="auto": what each budget learnt, kept between calls

    def compile_forwards(self, mode: str | None = "default",
                         call_batch_sizes: Sequence[int] | None = None) -> LlamaGenPipeline:
        """`torch.compile` the step forwards of the transformer and of the drafters present
        (`mmspec.compile.compile_cached_lm`; "reduce-overhead" adds CUDA graphs on a GPU); `mode=None` undoes it;
        "auto" compiles each model where `mmspec profile --compile` measured that it pays on this device, dtype and
        thread count (`mmspec.compile.auto_compile_mode`), and leaves it eager otherwise; given the images per call of
        the calls to come (`call_batch_sizes`), also where the compilation would cost more than those calls' image
        tokens of forwards save (`mmspec.compile.compile_pays_for_job`). The first image of each batch size and
        method pays the compilation (seconds to a minute)."""
        from mmspec.compile import JobSize, check_compile_mode, compile_as_measured

        if mode is not None:
            check_compile_mode(mode, " (compile_forwards)", auto=True)
        job = None
        if call_batch_sizes is not None:
            job = JobSize(tuple(int(b) for b in call_batch_sizes), self.image_token_layout()[0])
        for name in ("transformer", "draft_transformer", "eagle_drafter"):
            if getattr(self, name) is not None:
                compile_as_measured(getattr(self, name), mode, job, name)
        return self

    def default_guidance_scale(self) -> float:
        """The CFG scale a call uses when it gives none: the transformer's `default_guidance_scale` (set by the
        official t2i conversion to the sampling script's 7.5, by `mmspec train llamagen-t2i` to the scale that
        follows the captions best), else 4.0 (LlamaGen's class-conditional default)."""
        found = getattr(self.transformer.config, "default_guidance_scale", None)
        return float(DEFAULT_GUIDANCE if found is None else found)

    # ------------------------------------------------------------ what the methods read (`ImageTokenPipeline`)
    def image_token_layout(self) -> tuple[int, int, int]:
        """(image tokens per image, tokens per image row, code vocabulary size)."""
        config = self.transformer.config
        return config.block_size, grid_size_of(config.block_size), config.vocab_size

    def image_size(self) -> int:
        """The side in pixels of the images it makes: the token grid's side x the VQ's downsampling factor."""
        return grid_size_of(self.transformer.config.block_size) * self.vqvae.downsample_factor

    def code_vectors(self, as_decoded: bool = False) -> torch.Tensor:
        """The VQ codebook [V, C]: raw vectors (LANTERN's table, as the reference code) or, as_decoded, the
        L2-normalised latents the decoder sees."""
        return self.vqvae.codebook() if as_decoded else self.vqvae.quantize.embedding.weight

    def input_token_embeddings(self) -> torch.Tensor:
        """[V, dim] the transformer's input token embeddings (GSD's table, as the official code)."""
        return self.transformer.tok_embeddings.weight

    def image_token_ids(self) -> None:
        """None: every token of the vocabulary is an image code."""
        return None

    # ----------------------------------------------------------------------------------------- inputs
    def encode_prompt(self, prompt: str | list[str], num_images_per_prompt: int = 1,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Captions -> (prompt_embeds [N, cls_token_num, caption_dim], prompt_embeds_mask [N, cls_token_num] bool),
        left-padded with padding zeroed, each caption repeated num_images_per_prompt times: what the official
        sampling script feeds the GPT (`image_ar.llamagen.text`)."""
        check(self.transformer.config.model_type == "t2i",
              "this is a class-conditional (c2i) model: pass class_labels, not a prompt.")
        check(self.text_encoder is not None, "this t2i pipeline has no text_encoder: pass prompt_embeds and "
                                             "prompt_embeds_mask, or load the pipeline with text_encoder= (a "
                                             "transformers T5EncoderModel) and tokenizer=.")
        ids, mask = tokenize_captions(self.tokenizer, check_prompts(prompt), self.transformer.config.cls_token_num,
                                      self.config.clean_caption)
        device = self.text_encoder.device
        with torch.no_grad():  # as the official embedder (torch picks another SDPA kernel under autograd)
            features, mask = caption_condition(self.text_encoder, ids.to(device), mask.to(device))
        features = features.to(self.transformer.dtype)
        return (features.repeat_interleave(num_images_per_prompt, dim=0),
                mask.repeat_interleave(num_images_per_prompt, dim=0))

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
        check(class_labels is None, "this is a text-conditional (t2i) model: pass a prompt (or prompt_embeds), not "
                                    "class_labels.")
        check(isinstance(prompt_embeds, torch.Tensor) and prompt_embeds.dim() == 3,
              "prompt_embeds must be [B, cls_token_num, caption_dim] caption features (e.g. flan-t5-xl).")
        cond = prompt_embeds.repeat_interleave(num_images_per_prompt, dim=0).to(device)
        check_generators(generator, cond.shape[0])
        return cond

    # ------------------------------------------------------------------------------------------- call
    @torch.no_grad()
    def __call__(self, class_labels: int | list[int] | torch.Tensor | None = None,
                 prompt_embeds: torch.Tensor | None = None, prompt_embeds_mask: torch.Tensor | None = None,
                 guidance_scale: float | None = None, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 num_images_per_prompt: int = 1, generator: torch.Generator | list[torch.Generator] | None = None,
                 method: str = "vanilla", method_kwargs: dict[str, Any] | None = None, budget: str | None = None,
                 output_type: str = "pil", return_dict: bool = True,
                 callback_on_step_end: Callable[[Any, int, int, dict], Any] | None = None,
                 callback_on_step_end_tensor_inputs: list[str] | None = None,
                 prompt: str | list[str] | None = None, negative_prompt: str | list[str] | None = None,
                 negative_prompt_embeds: torch.Tensor | None = None,
                 negative_prompt_embeds_mask: torch.Tensor | None = None,
                 num_inference_steps: int | None = None):
        """Generate images.

        class_labels (c2i) or prompt (t2i: one caption or a list; `pipe("a red circle")` passes it first, as in
        diffusers; needs the text_encoder) or prompt_embeds + prompt_embeds_mask (left-padded caption features, as
        `encode_prompt` returns them). negative_prompt / negative_prompt_embeds (+ mask): one or one per caption;
        the CFG null rows then read it instead of the learned unconditional caption (not in the official code).
        guidance_scale: CFG scale (1.0 disables the unconditional half; None = `default_guidance_scale()`, the
        transformer's own default: 4.0 unless its config says otherwise). temperature 0 = greedy; top_k 0 and
        top_p 1.0 disable those filters. generator: one, or one per image (then each image is independent of
        the batch it was generated in). callback_on_step_end(pipe, step, num_tokens, {"tokens": [N, T]}) runs
        after every loop iteration (read-only; a function or a diffusers `PipelineCallback`; setting
        `pipe._interrupt = True` or returning {"stop": True} ends the call early, e.g. a UI's cancel button: the
        tokens not made are -1 and decode from a zero latent vector, `LlamaGenVQ.decode_code(fill_missing=True)`).
        output_type "pil" (default), "np", "pt" or "latent" (the tokens); return_dict=False returns `(images,)`.
        num_inference_steps (diffusers' name) is refused: the step count is the image's token count.
        budget: "auto" picks each step's draft size (0 = a plain step; a smaller tree or a chain for the EAGLE
        methods) from this device's measured step costs and the acceptance seen so far (`mmspec.budget`; the first
        call per model, device and batch size times the costs, then they are cached; what a budget learnt stays in
        `pipe.budgets` between calls), so no method is much slower than vanilla where drafting does not pay (a large
        batch, a CPU); "fixed" drafts the method's configured size every step (the papers' loops); None (default)
        is "auto" for lossless methods and "fixed" for relaxed ones (LANTERN, GSD: their output law depends on the
        drafts, so a seeded call must not depend on the machine's timings). Lossless methods stay lossless either
        way, and under the coupled rule (the default of sampled lossless methods) a seeded call gives the same
        tokens whatever the budget drafts.
        """
        check_no_inference_steps(num_inference_steps, f"it makes one token per image position, so its "
                                                      f"{self.transformer.config.block_size} steps are fixed by the "
                                                      "image size (a speculative method= takes fewer).")
        guidance_scale = self.default_guidance_scale() if guidance_scale is None else guidance_scale
        check(isinstance(guidance_scale, (int, float)), f"guidance_scale must be a number, got {guidance_scale!r}.")
        user_step = self.step_callback(callback_on_step_end, callback_on_step_end_tensor_inputs,
                                       self.transformer.config.block_size)
        params = SamplingParams(temperature, top_k, top_p)
        check_output_type(output_type)
        FAMILY.get_method(method).check_given(method_kwargs, "LlamaGen")  # before the text encoder runs
        if is_caption_list(class_labels):  # pipe("a red circle"): diffusers' first argument
            check(prompt is None, "pass the caption once: as the first argument or as prompt=, not both.")
            prompt, class_labels = class_labels, None
        if prompt is not None:
            check(prompt_embeds is None, "pass prompt or prompt_embeds, not both.")
            prompt_embeds, prompt_embeds_mask = self.encode_prompt(prompt)
        if negative_prompt is not None:
            check(negative_prompt_embeds is None, "pass negative_prompt or negative_prompt_embeds, not both.")
            negative_prompt_embeds, negative_prompt_embeds_mask = self.encode_prompt(negative_prompt)
        cond = self._conditions(class_labels, prompt_embeds, num_images_per_prompt, generator, output_type)
        batch = cond.shape[0]
        guided = guidance_scale != 1.0
        cond_mask = per_image(prompt_embeds_mask, num_images_per_prompt, cond, "prompt_embeds_mask")
        negative = per_image(negative_prompt_embeds, num_images_per_prompt, cond, "negative_prompt_embeds")
        negative_mask = per_image(negative_prompt_embeds_mask, num_images_per_prompt, cond,
                                  "negative_prompt_embeds_mask")
        check(negative is None or (guided and list(negative.shape[1:]) == list(cond.shape[1:])),
              "negative_prompt(_embeds) needs CFG (guidance_scale != 1) and caption features shaped like the prompt's.")
        ctx = MethodContext(self, params, guidance_scale if guided else None,
                            condition_prefill(guided, cond_mask, negative, negative_mask), batch)
        drafter, rule = FAMILY.get_method(method).build(ctx, method_kwargs, "LlamaGen")

        from mmspec.lm import LMTarget, room_for_drafts  # the target: the transformer with CFG, under the params

        block = self.transformer.config.block_size
        target = LMTarget(self.transformer, params, max_new_tokens=block, max_draft_nodes=room_for_drafts(drafter),
                          guidance_scale=ctx.guidance_scale, prefill_fn=ctx.prefill_fn)
        for model in (self.transformer, self.draft_transformer):  # positions are bounded here; no per-call sync
            if model is not None:
                model.check_positions = False
        draft_budget = make_budget(budget, target, drafter, rule, batch, self.budgets)

        gen = self.with_token_progress(block, user_step, lambda on_step: generate(
            target, drafter, rule, cond, batch_size=batch, max_new_tokens=block, generator=generator,
            device=cond.device, callback=on_step, budget=draft_budget))

        tokens = gen.tokens  # [N, block]; -1 where an interrupted call made no token
        return finish_generation(self, tokens, lambda: (self.vqvae.decode_code(tokens, fill_missing=True) + 1) / 2,
                                 output_type, return_dict, gen.stats)
