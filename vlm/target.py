"""A transformers VLM as the loop's target: `CachedVLM` (any model with `model.language_model` and `lm_head`),
`LlavaCachedLM` (`LlavaForConditionalGeneration`: vision tower + projector + text model) and, in `vlm.qwen2_vl`,
Qwen2-VL / Qwen2.5-VL; `cached_vlm(model)` picks the class and refuses anything else in one line.

The target implements `mmspec.lm.CachedLM` by running the model's own modules: image features come from the
model's `get_image_features`, and every step is one forward of its text model (`mmspec.hf_cache.run_text_model`:
its decoder layers, norms, rotary embedding and attention implementation) over mmspec's `StaticKVCache`, with a
4-D mask. Tree verification (one forward over all draft nodes under a tree mask), chain rollback and tree-path
compaction then work the same as for the image families, and the logits are transformers' own for any text
backbone it has (a real LLaVA-1.5 checkpoint loaded with `from_pretrained` works the same).

Prompts are ragged: rows are RIGHT-padded, and prefill commits each row's own length, so a row's cache holds
exactly its prompt and generated tokens sit at their true positions (`slots == positions`); padded entries lie
beyond the row's length, invisible, and are overwritten by the first generated tokens.

    lm = LlavaCachedLM(model)
    inputs = VLMInputs(input_ids, attention_mask, pixel_values)       # right padding
    target = LMTarget(lm, SamplingParams(temperature=0.0), max_new_tokens=64, prefill_fn=prefill_vlm)
    out = generate(target, NoDrafter(), "greedy", inputs, batch_size=B, max_new_tokens=64, eos_token_id=eos)

`last_hidden` [B, S, H] after each forward is the post-norm hidden state that feeds the LM head (EAGLE's
feature f_t). Image features replace the `<image>` placeholder embeddings in order, and a count mismatch is an
InputError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mmspec.cache import StaticKVCache
from mmspec.errors import InputError, check
from mmspec.hf_cache import check_attention_support, run_text_model
from mmspec.lm import hidden_at

Grid = tuple[int, int, int, int]  # (offset, height, width, row_stride): a rectangle of one image run's tokens


def square_grid(side: int) -> list[Grid]:
    """The grids of a run that is one side x side feature map (LLaVA-1.5's 24 x 24, Gemma 3's 16 x 16)."""
    return [(0, side, side, side)]


def image_run_lengths(input_ids: torch.Tensor, image_token_id: int) -> list[int]:
    """The length of every run of image tokens in input_ids [B, P], row by row (the images in order)."""
    is_image = torch.nn.functional.pad(input_ids == image_token_id, (1, 1))  # [B, P + 2]
    edges = (is_image[:, 1:] != is_image[:, :-1]).nonzero()[:, 1].view(-1, 2)  # [runs, (start, end)]
    return (edges[:, 1] - edges[:, 0]).tolist()


@dataclass
class VLMInputs:
    """A batch of prompts: input_ids, attention_mask [B, P] (right padding: 1 = real token), pixel_values for the
    images in row order as the model's processor gives them (LLaVA [N, 3, H, W]; Qwen2-VL flattened patches
    [sum t*h*w, C*T*P*P]), None for text-only prompts; `extras` the processor's other model inputs the target reads
    (Qwen2-VL: image_grid_thw [N, 3], mm_token_type_ids [B, P])."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    pixel_values: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids, mask = self.input_ids, self.attention_mask
        check(isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] >= 1 and not ids.is_floating_point(),
              f"input_ids must be an integer tensor [B, P], got {list(getattr(ids, 'shape', []))}.")
        check(isinstance(mask, torch.Tensor) and mask.shape == ids.shape,
              f"attention_mask must match input_ids {list(ids.shape)}, got {list(getattr(mask, 'shape', []))}.")
        real = mask.bool()
        lengths = real.sum(-1)
        check(bool((lengths >= 1).all()), "every prompt needs at least one real token.")
        right_padded = torch.arange(ids.shape[1], device=ids.device) < lengths.unsqueeze(-1)
        check(bool((right_padded == real).all()),
              "prompts must be right-padded (real tokens first); tokenize with padding_side='right'.")

    @property
    def lengths(self) -> torch.Tensor:
        return self.attention_mask.long().sum(-1)  # [B]


# text backbones run exactly: the text model's own forward (any decoder layer transformers has); each is proven
# against transformers' greedy `generate` (tests/vlm/test_vlm_backbones.py)
SUPPORTED_TEXT_MODELS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
M_ROPE_MODELS = ("qwen2_vl", "qwen2_5_vl")  # Qwen2-VL / Qwen2.5-VL: their own text model, M-RoPE positions
TILED_MODELS = ("llava_next", "llava_onevision")  # any-resolution tiles: image runs vary with the image size
BIDIRECTIONAL_IMAGE_MODELS = ("gemma3",)  # Gemma 3: an image's tokens attend to each other both ways in prefill
SUPPORTED = ("LlavaForConditionalGeneration (LLaVA-1.5), LlavaNextForConditionalGeneration (LLaVA-NeXT) and "
             "LlavaOnevisionForConditionalGeneration (images) with a Llama, Mistral, Qwen2, Qwen3 or Gemma 1/2/3 "
             "text backbone, Qwen2VLForConditionalGeneration and Qwen2_5_VLForConditionalGeneration (images), "
             "Gemma3ForConditionalGeneration (images); InternVL and others are not supported yet")


def check_supported_config(config, where: str = "the VLM target") -> None:
    """InputError (one line) unless `config` (a transformers config or its dict) is a LLaVA-1.5 model whose text
    backbone mmspec's target runs exactly: anything else would run without an error and give other tokens."""
    config = config if isinstance(config, dict) else config.to_dict()  # nested configs become dicts too
    model_type, text = config.get("model_type"), config.get("text_config") or {}
    text_type = text.get("model_type")
    if model_type in M_ROPE_MODELS or (model_type in BIDIRECTIONAL_IMAGE_MODELS and text_type == "gemma3_text"):
        return
    if model_type not in ("llava", *TILED_MODELS):
        classes = ", ".join(config.get("architectures") or []) or "no architectures listed"
        raise InputError(f"{where} is a {model_type!r} model ({classes}); mmspec supports {SUPPORTED}.")
    if text_type not in SUPPORTED_TEXT_MODELS:
        raise InputError(f"{where} is a {model_type} model with a {text_type!r} text backbone, which mmspec has not "
                         f"proven exact; mmspec supports {SUPPORTED}.")


class CachedVLM:
    """A transformers VLM (`model.model.language_model` + `model.lm_head`) with a static KV cache: `forward_cached`
    (token steps) and `forward_embeds` (prefill from merged embeddings); logits in float32, `last_hidden` kept.
    A family subclass says how images become features (`image_features`) and where tokens sit in the model's
    rotary positions (`prompt_positions`, `step_positions`)."""

    family = "a transformers VLM"
    images_nested_per_row = False  # the processor takes one flat list of images (True: a list per prompt)

    def __init__(self, model, attention_backend: str | None = None) -> None:
        inner = getattr(model, "model", None)
        check(inner is not None and hasattr(inner, "language_model") and hasattr(model, "lm_head")
              and hasattr(model, "config"), f"expected {self.family}, got {type(model).__name__}; mmspec supports "
                                            f"{SUPPORTED}.")
        check_supported_config(model.config, f"the target ({type(model).__name__})")
        check_attention_support(inner.language_model.config, f"the target's text model ({type(model).__name__})",
                                attention_backend)
        # sliding-window attention (Mistral, Qwen2/3 when used, Gemma 2/3's local layers): the masks apply the window
        # by sequence index, as transformers does (`mmspec.hf_cache.sliding_window_masks`)
        cfg = model.config.text_config
        window = getattr(cfg, "sliding_window", None)
        self.window = window if window and getattr(cfg, "use_sliding_window", True) else None
        self.model, self.backend = model, attention_backend
        self.text = inner.language_model
        self.num_layers, self.num_heads = cfg.num_hidden_layers, cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.image_token_id = image_token_id(model.config)
        # the model's own input embedding module, looked up once (`get_input_embeddings` walks the model: 9 us, more
        # than the lookup itself, paid by every drafted token)
        self.input_embeddings = model.get_input_embeddings()
        self.last_hidden: torch.Tensor | None = None  # [B, S, H] post-norm features of the last forward
        self.prompt_embeds: torch.Tensor | None = None  # [B, P, H] merged input embeddings of the last prefill
        self.layer_inputs: dict[int, torch.Tensor] = {}  # captured layers' inputs of the last forward (EAGLE-3)
        self.aux_layer_ids: tuple[int, ...] = ()

    def capture_layer_inputs(self, layer_ids: tuple[int, ...]) -> None:
        """Keep the inputs of these text-model decoder layers at every forward (transformers' `hidden_states[i]`:
        what an EAGLE-3 drafter fuses, `mmspec.eagle3`), read as `last_aux`. A forward pre-hook on each layer (the
        model's own forward is untouched); capturing again with the same ids adds nothing."""
        layers = self.text.layers
        check(all(0 <= i < len(layers) for i in layer_ids), f"the drafter fuses the inputs of layers "
                                                            f"{list(layer_ids)}, but the target has {len(layers)}.")
        for i in sorted(set(layer_ids) - set(self.layer_inputs)):
            self.layer_inputs[i] = None

            def keep(module, args, kwargs, i=i):
                self.layer_inputs[i] = args[0] if args else kwargs["hidden_states"]

            layers[i].register_forward_pre_hook(keep, with_kwargs=True)
        self.aux_layer_ids = tuple(layer_ids)

    @property
    def last_aux(self) -> torch.Tensor | None:
        """[B, S, 3H] the captured layers' inputs of the last forward, in `aux_layer_ids` order (None before one)."""
        parts = [self.layer_inputs.get(i) for i in self.aux_layer_ids]
        return None if not parts or any(p is None for p in parts) else torch.cat(parts, dim=-1)

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def fixed_image_tokens(self) -> int | None:
        """The length of every image's token run when the model fixes it (one grid for all images), else None."""
        return None

    def image_grids(self, inputs: VLMInputs, embeds: torch.Tensor) -> list[list[Grid]]:
        """The 2D feature maps of every image's run, in order (what SpecVLM's pooling works on); embeds [B, P, H]
        are the prompt's merged embeddings. By default from the fixed run length (`fixed_square_grid`)."""
        return [self.fixed_square_grid() for _ in image_run_lengths(inputs.input_ids, self.image_token_id)]

    def fixed_square_grid(self) -> list[Grid]:
        """The grid of a fixed run: a g x g square, after a class token when the run is g^2 + 1 (LLaVA's "full"
        feature selection keeps CLIP's CLS first); InputError (one line) otherwise."""
        tokens = self.fixed_image_tokens or 0
        side = math.isqrt(tokens)
        cls = next((c for c in (0, 1) if side > 0 and side * side + c == tokens), None)
        check(cls is not None, f"SpecVLM pools each image's 2D grid, which mmspec does not know for {self.family} "
                               f"({tokens or 'varying'} tokens per image): use the eagle, vispec or msd drafter.")
        return [(cls, side, side, side)]

    def new_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        w = self.model.lm_head.weight
        return StaticKVCache(self.num_layers, batch_size, self.num_kv_heads, capacity, self.head_dim, w.dtype,
                             w.device)

    # ------------------------------------------------------------------------------------------- inputs
    def image_features(self, inputs: VLMInputs) -> list[torch.Tensor]:
        """The projected features of each image, in order: a list of [T_img, H_text] (family-specific)."""
        raise NotImplementedError

    @torch.no_grad()
    def embed_inputs(self, inputs: VLMInputs) -> torch.Tensor:
        """Token embeddings [B, P, H] with every image placeholder replaced by an image feature, in order."""
        ids = inputs.input_ids.to(self.device)
        is_image = ids == self.image_token_id  # [B, P]
        # image placeholders are embedded as token 0 and then replaced (Gemma 3's image id lies past its vocabulary)
        embeds = self.embed_tokens(ids.masked_fill(is_image, 0))  # [B, P, H]
        n_slots = int(is_image.sum())
        if inputs.pixel_values is None:
            check(n_slots == 0, f"the prompts hold {n_slots} image tokens but no pixel_values were given.")
            return embeds
        features = self.image_features(inputs)  # N x [T_img, H]
        n_features = sum(f.shape[0] for f in features)
        if n_features != n_slots:
            sizes = ", ".join(str(f.shape[0]) for f in features)
            raise InputError(f"{len(features)} image(s) give {n_features} feature tokens ({sizes}) but the prompts "
                             f"hold {n_slots} <image> tokens (id {self.image_token_id}); let the model's processor "
                             "expand the image placeholders.")
        return embeds.masked_scatter(is_image.unsqueeze(-1), torch.cat(features).to(embeds))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The model's own input embeddings of token ids [B, S] -> [B, S, H] (as its forward embeds them)."""
        return self.input_embeddings(ids)

    def prompt_positions(self, inputs: VLMInputs, slots: torch.Tensor) -> torch.Tensor:
        """The rotary positions of the prompts' tokens in the model's layout (slots [B, P] = token indices)."""
        return slots

    def prompt_mask(self, inputs: VLMInputs, mask: torch.Tensor) -> torch.Tensor:
        """The prefill mask [B, P, T] the model's own generation applies to the prompts (default: causal, as given)."""
        return mask

    def step_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The model's rotary positions of generated / draft tokens at loop positions [B, S] (cache index + depth)."""
        return positions

    # -------------------------------------------------------------------------------------------- steps
    @property
    def attends_without_mask(self) -> bool:
        """`forward_cached` takes mask None (`mmspec.lm.CachedLM`) unless a sliding window needs the mask."""
        return self.window is None

    def forward_cached(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                       slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tokens, positions, slots [B, S]; mask [B, S, T] or None (every key up to the cache's visible end). Writes
        K/V at `slots`; returns logits [B, S, V]."""
        return self.forward_embeds(self.embed_tokens(tokens.to(self.device)), self.step_positions(positions), cache,
                                   slots, mask, seq_positions=positions)

    @torch.no_grad()
    def forward_embeds(self, x: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, slots: torch.Tensor,
                       mask: torch.Tensor, seq_positions: torch.Tensor | None = None,
                       head_at: torch.Tensor | None = None) -> torch.Tensor:
        """Input embeddings x [B, S, H] at the model's `positions`; K/V written at `slots` [B, S]; mask [B, S, T];
        seq_positions [B, S]: the entries' sequence indices (default the slots) where a sliding window applies;
        logits [B, S, V] float32, or [B, 1, V] at one entry per row `head_at` [B] (`mmspec.lm.hidden_at`)."""
        self.last_hidden = run_text_model(self.text, x, positions, cache, slots, mask, self.backend,  # [B, S, H]
                                          window=self.window, seq_positions=seq_positions)
        return self.model.lm_head(hidden_at(self.last_hidden, head_at)).float()


class LlavaCachedLM(CachedVLM):
    """`LlavaForConditionalGeneration` (LLaVA-1.5 layout): one run of `image_seq_length` tokens per image, token
    index = rotary position."""

    family = "a transformers LlavaForConditionalGeneration"

    @property
    def fixed_image_tokens(self) -> int | None:
        return getattr(self.model.config, "image_seq_length", None)

    @torch.no_grad()
    def image_features(self, inputs: VLMInputs) -> list[torch.Tensor]:
        """pixel_values -> N x [T_img, H_text], by the model's own `get_image_features`."""
        pixels = inputs.pixel_values.to(self.device, self.model.lm_head.weight.dtype)
        out = self.model.model.get_image_features(pixel_values=pixels, **self.feature_inputs(inputs))
        return list(getattr(out, "pooler_output", out))  # transformers 5: a list of [T_img, H_text], one per image

    def feature_inputs(self, inputs: VLMInputs) -> dict:
        """What `get_image_features` reads besides the pixels (LLaVA-1.5: the feature layer and selection)."""
        cfg = self.model.config
        return {"vision_feature_layer": cfg.vision_feature_layer,
                "vision_feature_select_strategy": cfg.vision_feature_select_strategy}


class LlavaTiledCachedLM(LlavaCachedLM):
    """LLaVA-NeXT and LLaVA-OneVision: an image is a base view plus any-resolution tiles, unpadded to its aspect,
    with a newline token per grid row (the model's own `get_image_features` packs them), so its run of image tokens
    depends on its size; `extras` carries the processor's image_sizes (and OneVision's batch_num_images). Token
    index = rotary position, as LLaVA-1.5."""

    family = "a transformers LlavaNextForConditionalGeneration or LlavaOnevisionForConditionalGeneration"
    fixed_image_tokens = None  # runs vary with the image size

    def feature_inputs(self, inputs: VLMInputs) -> dict:
        check("pixel_values_videos" not in inputs.extras, "videos are not supported by mmspec's VLM targets yet; "
                                                          "give images.")
        check("image_sizes" in inputs.extras, "LLaVA-NeXT / OneVision images need image_sizes (from the model's "
                                              "processor) next to pixel_values: pass VLMInputs(..., "
                                              "extras={'image_sizes': ...}).")
        sizes = {k: v.to(self.device) for k, v in inputs.extras.items() if k in ("image_sizes", "batch_num_images")}
        return {**super().feature_inputs(inputs), **sizes}

    def image_grids(self, inputs: VLMInputs, embeds: torch.Tensor) -> list[list[Grid]]:
        """Each run = the base view (g x g, g = the vision tower's patches a side), then the tiles unpadded to the
        image's aspect as `rows` lines of `width` tokens, each line ended by the model's image_newline (only a
        newline after the base view when the image has one view): two grids, the newlines in neither. Read off
        the merged embeddings, where the newlines sit as the model's packing put them."""
        vision = self.model.config.vision_config
        g = vision.image_size // vision.patch_size
        newline = self.model.model.image_newline.to(embeds.dtype)  # [H]
        is_image = inputs.input_ids.to(embeds.device) == self.image_token_id  # [B, P]
        grids = []
        for run in embeds[is_image].split(image_run_lengths(inputs.input_ids, self.image_token_id)):  # [T, H] each
            ends = (run[g * g:] == newline).all(-1).nonzero().flatten().tolist()  # newline offsets after the base
            width = ends[0] if ends else -1
            rows = len(ends)
            check(width >= 0 and ends == [r * (width + 1) + width for r in range(rows)]
                  and len(run) == g * g + rows * (width + 1),
                  f"an image run of {len(run)} tokens is not a {g}x{g} base view plus newline-ended tile rows.")
            grids.append(square_grid(g) + ([(g * g, rows, width, width + 1)] if width else []))
        return grids


def cached_vlm(model, attention_backend: str | None = None) -> CachedVLM:
    """The `CachedVLM` of a supported transformers VLM (InputError, one line, naming the supported ones otherwise)."""
    config = getattr(model, "config", None)
    check(config is not None, f"expected a transformers VLM, got {type(model).__name__}; mmspec supports "
                              f"{SUPPORTED}.")
    if getattr(config, "model_type", None) in M_ROPE_MODELS:
        from vlm.qwen2_vl import Qwen2VLCachedLM

        return Qwen2VLCachedLM(model, attention_backend)
    if getattr(config, "model_type", None) in TILED_MODELS:
        return LlavaTiledCachedLM(model, attention_backend)
    if getattr(config, "model_type", None) in BIDIRECTIONAL_IMAGE_MODELS:
        from vlm.gemma3 import Gemma3CachedLM

        return Gemma3CachedLM(model, attention_backend)
    return LlavaCachedLM(model, attention_backend)


def image_token_id(config) -> int:
    """The placeholder id image features replace (LLaVA's `image_token_index`, Qwen2-VL's `image_token_id`)."""
    found = getattr(config, "image_token_id", None)
    return config.image_token_index if found is None else found


def prefill_vlm(model: CachedVLM, inputs: VLMInputs, extra_capacity: int) -> tuple[StaticKVCache, torch.Tensor]:
    """`LMTarget`'s prefill for VLM prompts: embed (images merged), run the right-padded batch causally, commit
    each row's own length; returns (cache, logits for each row's first new token [B, 1, V])."""
    check(isinstance(inputs, VLMInputs), f"VLM targets take VLMInputs, got {type(inputs).__name__}.")
    embeds = model.embed_inputs(inputs)  # [B, P, H]
    model.prompt_embeds = embeds  # drafters that read the target's input embeddings (EagleVLM) take them here
    b, p, _ = embeds.shape
    cache = model.new_cache(b, p + extra_capacity)
    slots = cache.slots(p)  # [B, P] == token indices (right padding)
    positions = model.prompt_positions(inputs, slots)  # [B, P] or the model's layout ([3, B, P] for M-RoPE)
    with cache.keys_up_to(p):  # the prompts attend over their own P slots, not the room left for the answer
        mask = model.prompt_mask(inputs, cache.attention_mask(slots))  # [B, P, P]
        lengths = inputs.lengths.to(cache.device)  # [B]
        # the head at each row's last prompt position only; model.last_hidden keeps every one [B, P, H] (drafters)
        logits = model.forward_embeds(embeds, positions, cache, slots, mask, head_at=lengths - 1)  # [B, 1, V]
    cache.commit_chain(lengths)
    return cache, logits
