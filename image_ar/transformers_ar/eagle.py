"""The EAGLE drafter of transformers' AR image generators (Janus, Emu3) and its EAGLE-2 tree drafter for the loop.

The model is `mmspec.llama_drafter.LlamaFeatureDrafter` (fc over [e ; f], one Llama decoder layer, the target's
frozen head) bound to a `JanusCachedLM` or `Emu3CachedLM`:

    x_j = fc([embed(tok_j) ; f_j])     # embed: what the text model reads for a token (Janus: the generation
                                       # aligner over the generation embeddings; Emu3: its input embeddings)
    h_j = decoder layer(x_j) at position j + 1
    logits_j = head(h_j)               # Janus: the generation head (VQ codes); Emu3: the LM head

f_j is the target's final normed hidden state that predicts image token j (f_0 at the prompt's last position);
h_j regresses f_{j+1}. The drafter's cache holds image elements only (the prompt reaches it through f_0), as
LANTERN's LlamaGen drafter: element j at slot j, position j + 1 for every row, the conditional and unconditional
CFG rows alike (RoPE sees only differences, so where a row's prompt ended does not matter). With CFG the drafter
runs both halves with their own target features and combines its logits as the target does
(`mmspec.lm.GuidedRunner`) before ranking children.

Trained by `mmspec train image-ar-drafter` (`image_ar.transformers_ar.train_eagle`) and saved in
`MODEL_FOLDER/drafters/eagle`, where the pipelines' `from_pretrained` finds it; methods `eagle` and `lantern` then
run on the model. Emu3's layout (row-end and end-of-image tokens at fixed indices) binds the target's verdict, not
the drafter: the drafter's children are ranked without it (a drafted text token is rejected there).
"""

from __future__ import annotations

from typing import Any

import torch

from image_ar.llamagen.eagle import DEFAULT_DEPTH, DEFAULT_TOP_K, DEFAULT_TOTAL_TOKENS
from mmspec.errors import check
from mmspec.feature_drafter import FeatureTreeDrafter, PendingPairs
from mmspec.llama_drafter import LlamaFeatureDrafter, llama_drafter_config
from mmspec.lm import TokenLayout
from mmspec.loop import DecodeState
from mmspec.sampling import SamplingParams

# LANTERN's LlamaGen tree (top_k 10, its code's depth 4 = 5 draft levels, total 59), the LlamaGen family's default
DEFAULT_TREE = {"top_k": DEFAULT_TOP_K, "depth": DEFAULT_DEPTH, "total_tokens": DEFAULT_TOTAL_TOKENS}
RETRAIN = "train one for this model with `mmspec train image-ar-drafter --model FOLDER`"


class ImageAREagleDrafter(LlamaFeatureDrafter):
    """EAGLE drafter over a transformers AR image generator's `CachedLM` (see the module docstring)."""

    @classmethod
    def for_target(cls, lm: Any, **overrides: Any) -> ImageAREagleDrafter:
        """A fresh drafter shaped like the target's text model (its vocabulary: what its head scores), attached."""
        config = llama_drafter_config(lm.text_config, vocab_size=lm.vocab_size)
        return cls(**{**config, **overrides}).placed_like(next(lm.parameters())).attach(lm)

    def attach(self, lm: Any) -> ImageAREagleDrafter:
        """Share the target's embeddings and head (plain attributes: not saved); returns self."""
        check(hasattr(lm, "embed_tokens") and hasattr(lm, "head") and hasattr(lm, "prompt_lengths"),
              f"attach needs a JanusCachedLM or Emu3CachedLM (a pipeline's `lm`), got {type(lm).__name__}.")
        return self.bind(lm, {"hidden_size": lm.text_config.hidden_size, "vocab_size": lm.vocab_size},
                         RETRAIN)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(tokens)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.head(hidden)


class ImageAREagleTreeDrafter(FeatureTreeDrafter):
    """EAGLE-2 dynamic trees from an `ImageAREagleDrafter` (drafter element j at position j + 1). `begin` starts
    each row (both CFG halves) from its own last prompt feature; children are ranked after the target's sampling
    settings (LANTERN, `child_ranking="processed"`, as the LlamaGen family) unless child_ranking="raw", among the
    tokens the target's `layout` allows at their index when it has one (Emu3)."""

    def __init__(self, drafter: ImageAREagleDrafter, lm: Any, params: SamplingParams, *,
                 top_k: int = DEFAULT_TREE["top_k"], depth: int = DEFAULT_TREE["depth"],
                 total_tokens: int = DEFAULT_TREE["total_tokens"], guidance_scale: float | torch.Tensor | None = None,
                 child_ranking: str = "processed", layout: TokenLayout | None = None):
        super().__init__(drafter.attach(lm), lm, params, top_k=top_k, depth=depth, total_tokens=total_tokens,
                         position_offset=1, guidance_scale=guidance_scale, child_ranking=child_ranking, layout=layout)
        self.drafter = drafter

    def begin(self, inputs: Any, state: DecodeState) -> None:
        lengths = self.target.prompt_lengths  # [R] set by the target's prefill
        rows = state.batch_size * (2 if self.runner.uses_cfg else 1)
        check(lengths is not None and lengths.shape[0] == rows, "run the target's prefill first.")
        features = self.target_features(rows, int(self.target.last_hidden.shape[1]), "prefill")  # [R, P, H]
        last = (lengths - 1).to(features.device).view(-1, 1, 1).expand(-1, -1, features.shape[-1])
        self.new_drafter_cache(rows, state.max_new_tokens + self.width)
        self.pending = PendingPairs(state.last_token, features.gather(1, last)[:, 0], self.width)  # (f_0, tok_0)


ImageAREagleDrafter.loop_drafter = ImageAREagleTreeDrafter  # what the loop runs for this drafter model
