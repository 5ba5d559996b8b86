"""`LuminaMGPTPipeline`: Lumina-mGPT text-to-image with any discrete method of the shared loop, on transformers'
Chameleon modules and Chameleon's VQGAN (`image_ar.transformers_ar.lumina_mgpt` says what is built and why).

    pipe = LuminaMGPTPipeline.from_pretrained("lumina-mgpt-7b-768", dtype=torch.bfloat16, device="cuda")
    out = pipe("a red fox in the snow", method="sjd", generator=torch.Generator("cuda").manual_seed(0))
    out.images[0]                     # PIL, 768 x 768; out.stats: the run's SpecStats

The folder is what `mmspec convert lumina-mgpt` writes from an official one, 1.0 or 2.0 (transformers'
`ChameleonForConditionalGeneration` weights, the tokenizer, the image tokenizer in `vqgan/`: Chameleon's VQGAN, or
2.0's MoVQGAN). Defaults are the official ones: CFG 4.0, temperature 1, image top-k 2000 (1.0's README) or 4096
(2.0's sample script); the SJD and GSD papers used CFG 3.0 on 1.0. SJD's defaults (window 16, random init) are
2.0's official SJD settings. Methods are the LlamaGen
family's records: vanilla, sjd (accept="lossless" | "lantern" | "gsd"), gsd, and with an EAGLE drafter trained for
the model (`mmspec train image-ar-drafter`) eagle and lantern trees. GSD's table is the language model's input
embeddings (the official GSD code on Lumina-mGPT), LANTERN's neighbours the VQGAN codebook's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from image_ar.llamagen.vq import LlamaGenVQ
from image_ar.movqgan import MoVQGAN
from image_ar.transformers_ar.lumina_mgpt import (
    PATCH,
    ChameleonCachedLM,
    encode_prompts,
    image_header,
    image_token_codes,
    latent_grid,
    layout_length,
    lumina_layout,
    lumina_special_ids,
    token_rows,
    unconditional_rows,
)
from image_ar.transformers_ar.pipeline import (
    EAGLE_FOLDER,
    TransformersImagePipeline,
    check_prompt_list,
    has_eagle_drafter,
    vocabulary_lantern_table,
)
from image_ar.transformers_ar.prompts import Prompts, guided_prefill
from mmspec.errors import InputError, check
from mmspec.hf_loading import load_transformers_folder
from mmspec.sampling import SamplingParams

VQGAN_FOLDER = "vqgan"
DEFAULT_IMAGE_SIZE = 768  # when the folder's config.json does not record one (`lumina_mgpt.image_size`)
IMAGE_TOP_K = {1: 2000, 2: 4096}  # by version: the official README's (1.0) and sample script's (2.0) image top-k
VQ_CLASSES = {"LlamaGenVQ": LlamaGenVQ, "MoVQGAN": MoVQGAN}  # 1.0's Chameleon VQGAN, 2.0's MoVQGAN


def load_vq(folder: Path) -> LlamaGenVQ | MoVQGAN:
    """The image tokenizer in `folder` (a diffusers model folder; its config names the class)."""
    try:
        name = json.loads((folder / "config.json").read_text()).get("_class_name")
    except (OSError, json.JSONDecodeError) as err:
        raise InputError(f"could not read {folder / 'config.json'}: {err}") from None
    check(name in VQ_CLASSES, f"{folder} holds a {name!r}; a Lumina-mGPT folder's image tokenizer is one of "
                              f"{', '.join(VQ_CLASSES)} (`mmspec convert lumina-mgpt` writes it).")
    return VQ_CLASSES[name].from_pretrained(str(folder))


def read_lumina_config(folder: str | Path) -> dict:
    """config.json of a converted Lumina-mGPT folder; InputError (one line) for an official folder not yet
    converted, or another model."""
    path = Path(folder) / "config.json"
    check(path.is_file(), f"no Lumina-mGPT model in {folder}: expected a folder written by `mmspec convert "
                          "lumina-mgpt` (config.json, weights, tokenizer, vqgan/).")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise InputError(f"could not read {path}: {err}") from None
    official = "mask_image_logits" in config or "ChameleonXLLMXForConditionalGeneration" in config.get(
        "architectures", [])
    if config.get("model_type") == "chameleon" and "lumina_mgpt" not in config and official:
        raise InputError(f"{folder} is an official Lumina-mGPT folder: convert it once with `mmspec convert "
                         f"lumina-mgpt --model {folder} --vqgan vqgan.ckpt --out FOLDER` and load FOLDER.")
    check(config.get("model_type") == "chameleon" and "lumina_mgpt" in config,
          f"the model in {folder} (model_type {config.get('model_type')!r}) is not a converted Lumina-mGPT folder; "
          "`mmspec convert lumina-mgpt` writes one.")
    check((Path(folder) / VQGAN_FOLDER / "config.json").is_file(),
          f"{folder} has no {VQGAN_FOLDER}/ (Chameleon's VQGAN): convert the official folder with "
          "`mmspec convert lumina-mgpt ... --vqgan vqgan.ckpt`.")
    return config


class LuminaMGPTPipeline(TransformersImagePipeline):
    """Lumina-mGPT (1.0) or Lumina-mGPT 2.0: transformers' `ChameleonForConditionalGeneration` (`model`), the
    model's tokenizer (`processor`) and image tokenizer (`vqgan`: 1.0's Chameleon VQGAN, a `LlamaGenVQ`; 2.0's
    `MoVQGAN`, which makes the pipeline a 2.0 one)."""

    model_type, model_class = "lumina-mgpt", "ChameleonForConditionalGeneration"
    fallback_guidance = 4.0  # the official README's CFG (1.0) and sample script's (2.0)
    image_size_arguments = "height and width, multiples of 32 pixels"

    def __init__(self, model: Any, processor: Any = None, vqgan: Any = None, eagle_drafter: Any = None):
        super().__init__(model, processor, eagle_drafter)
        check(processor is not None and isinstance(vqgan, tuple(VQ_CLASSES.values())),
              "a Lumina-mGPT pipeline needs the model's tokenizer (processor=) and its image tokenizer (vqgan=: "
              "Chameleon's VQGAN as a LlamaGenVQ, or a MoVQGAN for Lumina-mGPT 2.0).")
        self.register_modules(vqgan=vqgan)
        self.version = 2 if isinstance(vqgan, MoVQGAN) else 1
        check(PATCH % vqgan.downsample_factor == 0, f"the image tokenizer codes {vqgan.downsample_factor} pixels a "
                                                     f"side; Lumina-mGPT's grid unit of {PATCH} needs a divisor.")
        self.codes_per_unit = PATCH // vqgan.downsample_factor
        self.lm = ChameleonCachedLM(model)
        ids, codes = image_token_codes(model)
        self.special = lumina_special_ids(processor, ids)
        check(max(codes) < vqgan.config.codebook_size, f"the vocabulary names {len(ids)} image tokens (codes up to "
                                                       f"{max(codes)}); the image tokenizer has "
                                                       f"{vqgan.config.codebook_size} codes.")
        self.code_of = torch.full((self.lm.vocab_size,), -1, dtype=torch.long)  # [V] token id -> code (-1: none)
        self.code_of[torch.tensor(ids)] = torch.tensor(codes)
        self.token_of_code = torch.zeros(vqgan.config.codebook_size, dtype=torch.long)  # [C] code -> token id
        self.token_of_code[torch.tensor(codes)] = torch.tensor(ids)
        self.grid: tuple[int, int] | None = None  # (H, W) latent codes of the running / last call

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, dtype: torch.dtype | None = None,
                        torch_dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                        **_: Any) -> LuminaMGPTPipeline:
        """A folder `mmspec convert lumina-mgpt` (or `save_pretrained`) wrote, in `dtype` when given; nothing
        downloads. An official folder not yet converted, or another model, is refused in one line first."""
        import transformers

        check(dtype is None or torch_dtype is None, "give dtype or torch_dtype, not both.")
        dtype = dtype if torch_dtype is None else torch_dtype
        read_lumina_config(folder)
        vqgan = load_vq(Path(folder) / VQGAN_FOLDER)
        # 2.0 does not use the Chameleon VQ-VAE transformers' class builds: its weights are not in the folder, and
        # the module is removed so nothing runs it at random init
        unused = "model.vqmodel." if isinstance(vqgan, MoVQGAN) else None
        model, tokenizer = load_transformers_folder(folder, transformers.ChameleonForConditionalGeneration,
                                                    transformers.AutoTokenizer, unused_prefix=unused,
                                                    attn_implementation="sdpa")
        if unused:
            del model.model.vqmodel
        moved = [m.eval().to(device) if dtype is None else m.eval().to(device=device, dtype=dtype)
                 for m in (model, vqgan)]
        pipe = cls(moved[0], tokenizer, moved[1])
        if has_eagle_drafter(folder):
            pipe.load_eagle_drafter(Path(folder) / EAGLE_FOLDER)
        return pipe

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> None:
        """The model and tokenizer in transformers' layout, the VQGAN in `vqgan/` (what `from_pretrained` reads)."""
        super().save_pretrained(save_directory, **kwargs)
        self.vqgan.save_pretrained(Path(save_directory) / VQGAN_FOLDER)

    @property
    def default_image_size(self) -> int:
        return int((getattr(self.model.config, "lumina_mgpt", None) or {}).get("image_size", DEFAULT_IMAGE_SIZE))

    @property
    def default_top_k(self) -> int:
        """The official image top-k of this version: 2000 (1.0's README), 4096 (2.0's sample script)."""
        return IMAGE_TOP_K[self.version]

    # ------------------------------------------------------------ what the methods read (`ImageTokenPipeline`)
    def image_token_layout(self) -> tuple[int, int, int]:
        """(generated tokens per image, tokens per image row incl. its row end, the whole vocabulary)."""
        check(self.grid is not None, "the layout is known once a call has its image size.")
        return layout_length(*self.grid), self.grid[1] + 1, self.lm.vocab_size

    def code_vectors(self, as_decoded: bool = False) -> torch.Tensor:
        raise InputError("GSD's codebook table needs a vocabulary of image codes; Lumina-mGPT's mixes text and image "
                         "tokens: use embeddings='target' (its input embeddings, the default) or None.")

    def lantern_table(self, k: int) -> torch.Tensor:
        """LANTERN's neighbours over the whole vocabulary from the image tokenizer's raw codebook."""
        return vocabulary_lantern_table(self.token_of_code, self.vqgan.quantize.embedding.weight, self.lm.vocab_size,
                                        k)

    def input_token_embeddings(self) -> torch.Tensor:
        """[V, H] the language model's input embeddings (GSD's table, as the official GSD code)."""
        return self.model.get_input_embeddings().weight

    def image_token_ids(self) -> torch.Tensor:
        return torch.tensor(self.special.visual)

    # ----------------------------------------------------------------------------------------- inputs
    def image_size(self, height: int | None, width: int | None) -> tuple[int, int]:
        size = self.default_image_size
        return (size if height is None else height), (size if width is None else width)

    def encode_prompt(self, prompt: str | list[str], height: int, width: int) -> Prompts:
        """Prompts -> right-padded ids: BOS, the official request text, the separator and the image header."""
        return encode_prompts(self.processor, self.special, check_prompt_list(prompt), height, width)

    def with_header(self, input_ids: Any, attention_mask: Any, height: int, width: int) -> Prompts:
        """Token ids of the conversation (BOS .. separator, any padding side) + the image header."""
        prompts = self.processor_prompts(input_ids, attention_mask)
        header = image_header(self.special, self.processor, height, width)
        return token_rows([row[:n].tolist() + header for row, n in zip(prompts.input_ids, prompts.lengths)])

    # ------------------------------------------------------------------------------------------- call
    @torch.no_grad()
    def __call__(self, prompt: str | list[str] | None = None, *, input_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, height: int | None = None, width: int | None = None,
                 guidance_scale: float | None = None, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float = 1.0, num_images_per_prompt: int = 1,
                 generator: torch.Generator | list[torch.Generator] | None = None, method: str = "vanilla",
                 method_kwargs: dict[str, Any] | None = None, budget: str | None = None, output_type: str = "pil",
                 return_dict: bool = True, callback_on_step_end: Callable[[Any, int, int, dict], Any] | None = None,
                 callback_on_step_end_tensor_inputs: list[str] | None = None, class_labels: Any = None,
                 num_inference_steps: int | None = None):
        """Generate images from prompts (one string or a list; or input_ids + attention_mask of the conversation
        as the official item processor tokenizes it: BOS, request text, separator).

        height / width: pixels, multiples of 32 (default the resolution the folder records, e.g. 768); the request
        text names them as the official prompts do. guidance_scale: None = the model's generation_config, else 4.0
        (the official README; 1.0 disables CFG). top_k None = the version's official image top-k (1.0: 2000, 2.0:
        4096; 0 disables);
        temperature 0 = greedy. method / method_kwargs / budget / generator / callbacks / return_dict /
        num_inference_steps as `JanusPipeline`.
        """
        self.check_call(prompt, input_ids, class_labels, method, output_type, num_images_per_prompt,
                        num_inference_steps)
        height, width = self.image_size(height, width)
        top_k = self.default_top_k if top_k is None else top_k
        prompts = (self.encode_prompt(prompt, height, width) if prompt is not None
                   else self.with_header(input_ids, attention_mask, height, width))
        prefill, guidance_scale, layout = self.guided_inputs(prompts.input_ids.shape[0] * num_images_per_prompt,
                                                             height, width, guidance_scale)
        gen = self.run_loop(self.lm, prompts.repeat(num_images_per_prompt), prefill, layout_length(*self.grid),
                            guidance_scale, SamplingParams(temperature, top_k, top_p), generator, method,
                            method_kwargs, budget, callback_on_step_end, callback_on_step_end_tensor_inputs,
                            layout=layout)
        return self.finish(gen, self.decode, output_type, return_dict)

    def guided_inputs(self, rows: int, height: int, width: int, guidance_scale: float | None):
        """(prefill(guided), scale, layout) of a call of `rows` rows at height x width pixels (the official CFG
        context: the image header alone; scale None: the default); sets the call's grid."""
        self.grid = latent_grid(height, width, self.codes_per_unit)
        negative = unconditional_rows(self.special, self.processor, rows, height, width)
        guidance_scale = self.default_guidance_scale() if guidance_scale is None else guidance_scale
        return (lambda guided: guided_prefill(guided, negative), guidance_scale,
                lumina_layout(self.special, *self.grid, self.lm.vocab_size))

    def scoring_inputs(self, prompts: list[str], guidance_scale: float | None):
        """(prompts, prefill(guided), scale, layout) as a call with these prompts (the default size) and this scale
        builds them."""
        height, width = self.image_size(None, None)
        return (self.encode_prompt(prompts, height, width), *self.guided_inputs(len(prompts), height, width,
                                                                                 guidance_scale))

    # ------------------------------------------------------------------------------------------ decode
    def codes(self, tokens: torch.Tensor) -> torch.Tensor:
        """Generated tokens [N, H (W + 1) + 1] -> VQ codes [N, H, W] (the row ends and `<eoss>` dropped, as the
        official `decode_image`; a position not generated, -1, stays -1)."""
        grid_h, grid_w = self.grid
        cells = tokens[:, : grid_h * (grid_w + 1)].reshape(-1, grid_h, grid_w + 1)[..., :grid_w]  # [N, H, W]
        code_of = self.code_of.to(cells.device)
        return torch.where(cells >= 0, code_of[cells.clamp_min(0)], -1)

    def decode_made(self, tokens: torch.Tensor, decode: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return decode(tokens)  # `decode` fills positions not generated itself (the VQGAN's fill_missing)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Generated tokens -> images [N, 3, f H, f W] in [0, 1] by the image tokenizer (f = 16 for 1.0's VQGAN, 8
        for 2.0's MoVQGAN; codes not generated decode from a zero latent vector)."""
        codes = self.codes(tokens.to(self.vqgan.device))
        pixels = self.vqgan.decode_code(codes, fill_missing=True)  # [N, 3, f H, f W] about [-1, 1]
        return ((pixels.float().clamp(-1, 1) + 1) / 2)
