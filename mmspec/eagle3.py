"""The EAGLE-3 drafter model (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test"), for any family whose target is a transformers model; its checkpoint format as the official
EAGLE-3 heads ship it and vLLM's and SGLang's EAGLE-3 loaders read it.

    a_i = [t_low ; t_mid ; t_high]_i   # [R, S, 3 H_t] the target's inputs of three decoder layers at position i
    g   = fc(a_i)                      # [R, S, H], no bias; a deeper draft reads the drafter's own output o instead
    x   = [input_layernorm(e_{i+1}) ; hidden_norm(g)]            # [R, S, 2H] e: the next token's embedding
    o   = g + attn(x) ;  o = o + mlp(post_attention_layernorm(o))  # one Llama decoder layer, its residual g
    logits = lm_head(norm(o))          # [R, S, V_d] the drafter's own head over its draft vocabulary

Draft token j is target token j + d2t[j] (`d2t` [V_d] offsets; `t2d` [V] marks the target tokens in the draft
vocabulary); `head` returns logits over the target's vocabulary with -inf outside it. The layer is a transformers
`LlamaDecoderLayer` whose q, k and v projections read 2H and whose input norm is `PairNorm` (`residual_from` = H:
`mmspec.draft_layers`). The target's layers are `aux_layer_ids` (the official default: 2, L // 2, L - 3 of L layers,
`default_aux_layers`), their inputs as transformers' `hidden_states[i]` gives them.

Training-time test (`ttt_loss`): the drafter is unrolled for `steps` steps over a teacher-forced sequence; step k's
element i reads the drafter's step-(k-1) output at i and the embedding of token i + 1 + k, attends to step 0's
elements up to i and to its own earlier steps at i alone (what a draft k levels deep sees at inference: the context,
then its ancestors), sits at position i + 1 + k, and is scored against the target's distribution of token i + 2 + k
with weight decay^k (EAGLE-3's 0.8).

Checkpoint keys (official, `to_official_state` / `from_official_state`): `fc.weight`, `midlayer.{input_layernorm,
hidden_norm, post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d` (and `embed_tokens.weight`
in heads that carry their own embeddings, not read here: the target's are used).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from mmspec.attention.model_backend import AttentionBackendMixin
from mmspec.errors import InputError, check
from mmspec.llama_drafter import LlamaFeatureDrafter, TargetBound

DECAY = 0.8  # EAGLE-3's weight of TTT step k's loss: DECAY ** k
TTT_STEPS = 7  # steps the official training unrolls (SpecForge's ttt_length)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The official choice of the target's layers whose inputs the drafter fuses: 2, L // 2 and L - 3, in layer
    order, clipped to the layers a small target has."""
    return tuple(sorted(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)))


class PairNorm(nn.Module):
    """EAGLE-3's input norms over x = [e ; g] [.., 2H]: [embeds(e) ; hidden(g)] (`input_layernorm`, `hidden_norm`)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.embeds, self.hidden = LlamaRMSNorm(hidden_size, eps), LlamaRMSNorm(hidden_size, eps)
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden_size
        return torch.cat([self.embeds(x[..., :h]), self.hidden(x[..., h:])], dim=-1)


class Eagle3Drafter(TargetBound, AttentionBackendMixin, ModelMixin, ConfigMixin):
    """EAGLE-3 drafter (see the module docstring); a family subclass binds a target (`embed_tokens`, the capture of
    the target's layer inputs)."""

    attends_without_mask = True  # forward_cached takes mask None (`mmspec.lm.CachedLM`)
    runs_one_column = True  # forward_cached takes query_column (`FeatureTreeDrafter.run_pending`)

    @register_to_config
    def __init__(self, hidden_size: int = 4096, num_attention_heads: int = 32, num_key_value_heads: int | None = None,
                 intermediate_size: int = 14336, rms_norm_eps: float = 1e-5, rope_theta: float = 500000.0,
                 max_position_embeddings: int = 8192, vocab_size: int = 128256, draft_vocab_size: int | None = None,
                 target_hidden_size: int | None = None, aux_layer_ids: tuple[int, ...] = (2, 16, 29),
                 attention_backend: str | None = None) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        check(len(aux_layer_ids) == 3, f"aux_layer_ids names three target layers, got {list(aux_layer_ids)}.")
        draft_vocab_size = draft_vocab_size or vocab_size
        text = LlamaConfig(hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                           num_key_value_heads=num_key_value_heads or num_attention_heads,
                           intermediate_size=intermediate_size, rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
                           max_position_embeddings=max_position_embeddings, vocab_size=vocab_size, num_hidden_layers=1)
        self.hidden_size, self.vocab_size, self.attention_backend = hidden_size, vocab_size, attention_backend
        self.fc = nn.Linear(3 * (target_hidden_size or hidden_size), hidden_size, bias=False)
        layer = LlamaDecoderLayer(text, layer_idx=0)
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads [e ; g]
            setattr(attn, name, nn.Linear(2 * hidden_size, getattr(attn, name).out_features, bias=False))
        layer.input_layernorm = PairNorm(hidden_size, rms_norm_eps)
        layer.residual_from = hidden_size  # the residual is g, the second half of the input
        self.layers = nn.ModuleList([layer])
        self.norm = LlamaRMSNorm(hidden_size, rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))  # [V_d] target id - draft id
        self.register_buffer("t2d", torch.ones(vocab_size, dtype=torch.bool) if draft_vocab_size == vocab_size
                             else torch.zeros(vocab_size, dtype=torch.bool))  # [V] in the draft vocabulary
        self.rotary_emb = LlamaRotaryEmbedding(text)
        self.last_hidden: torch.Tensor | None = None  # [R, S, H] outputs o of the last forward_cached

    # ------------------------------------------------------------------------------------------ vocabulary
    def set_draft_vocabulary(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary: target_ids [V_d] (distinct, increasing), draft token j = target token target_ids[j]."""
        check(target_ids.numel() == self.lm_head.out_features, f"the draft vocabulary holds "
                                                               f"{self.lm_head.out_features} tokens, got "
                                                               f"{target_ids.numel()}.")
        ids = target_ids.to(self.d2t.device, torch.long)
        check(bool((ids[1:] > ids[:-1]).all()) and 0 <= int(ids.min()) and int(ids.max()) < self.vocab_size,
              f"the draft vocabulary must be distinct increasing target ids below {self.vocab_size}.")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target id of each draft token [V_d]."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @property
    def full_vocabulary(self) -> bool:
        """The draft vocabulary is the target's (V_d = V: distinct increasing ids below V are every id, d2t = 0);
        read from the sizes, no device read per draft step."""
        return self.lm_head.out_features == self.vocab_size

    # ------------------------------------------------------------------------------------------ target
    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the target reads for tokens [R, S] -> [R, S, H] (the family's)."""
        raise NotImplementedError

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Outputs o [..., H] -> float32 logits over the draft vocabulary [..., V_d]."""
        return self.lm_head(self.norm(hidden)).float()

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Outputs o [..., H] -> float32 logits over the target's vocabulary [..., V] (-inf outside the draft one)."""
        logits = self.draft_logits(hidden)  # [..., V_d]
        if self.full_vocabulary:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        return full.index_copy_(-1, self.draft_to_target, logits)

    # ------------------------------------------------------------------------------------------ forward
    def fused_feature(self, features: torch.Tensor) -> torch.Tensor:
        """g [.., H]: fc(features) for the target's fused layer inputs [.., 3 H_t], the features themselves for the
        drafter's own outputs [.., H]."""
        dtype = self.fc.weight.dtype
        if features.shape[-1] == self.fc.in_features:
            return self.fc(features.to(dtype))
        if features.shape[-1] != self.hidden_size:
            raise InputError(f"features must be the target's fused layer inputs [.., {self.fc.in_features}] or the "
                             f"drafter's outputs [.., {self.hidden_size}], got {list(features.shape)}.")
        return features.to(dtype)

    def fuse(self, embeds: torch.Tensor, features: torch.Tensor, direct: torch.Tensor | None = None) -> torch.Tensor:
        """[e ; g] [R, S, 2H] with g = `fused_feature(features)`; elements where direct [R, S] is set read [e ; e]
        (an input that enters the layer as itself, its own residual: ViSpec's compressed image tokens)."""
        g = self.fused_feature(features)
        if g.shape[:-1] != embeds.shape[:-1]:
            raise InputError(f"features {list(features.shape)} do not match embeddings {list(embeds.shape)}.")
        e = embeds.to(g.dtype)
        if direct is not None:
            g = torch.where(direct.unsqueeze(-1), e, g)
        return torch.cat([e, g], dim=-1)

    new_cache = LlamaFeatureDrafter.new_cache  # one decoder layer's K/V, in fc's dtype and device
    # pairs (tokens or embeddings, features: the target's [R, S, 3 H_t] or the drafter's own [R, S, H]) through the
    # layer with the cache, as EAGLE-1/2's: logits over the target's vocabulary (`head`), `last_hidden` the outputs o
    forward_cached = LlamaFeatureDrafter.forward_cached

    # ------------------------------------------------------------------------------------------ format
    def to_official_state(self) -> dict[str, torch.Tensor]:
        """The state dict in the official EAGLE-3 key layout (see the module docstring)."""
        out = {}
        for name, tensor in self.state_dict().items():
            key = name.replace("layers.0.input_layernorm.embeds.", "midlayer.input_layernorm.")
            key = key.replace("layers.0.input_layernorm.hidden.", "midlayer.hidden_norm.")
            out[key.replace("layers.0.", "midlayer.")] = tensor.contiguous()
        return out

    @staticmethod
    def from_official_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An official EAGLE-3 state dict in this model's key layout (vLLM's `layers.0.` spelling of `midlayer.` read
        too; `embed_tokens.weight` passes as it is: the loader checks it against the target's embeddings)."""
        out = {}
        for key, tensor in state.items():
            key = key.replace("layers.0.", "midlayer.")
            key = key.replace("midlayer.input_layernorm.", "layers.0.input_layernorm.embeds.")
            key = key.replace("midlayer.hidden_norm.", "layers.0.input_layernorm.hidden.")
            out[key.replace("midlayer.", "layers.0.")] = tensor
        return out

    def official_config(self, architectures: str = "LlamaForCausalLMEagle3") -> dict[str, Any]:
        """config.json of the official format (a Llama config of one layer, the draft vocabulary, the target's
        width and the fused layers' ids under `eagle_config`)."""
        c = self.config
        return {"architectures": [architectures], "model_type": "llama", "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
                "num_key_value_heads": c.num_key_value_heads or c.num_attention_heads, "num_hidden_layers": 1,
                "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "hidden_act": "silu",
                "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
                "draft_vocab_size": self.lm_head.out_features,
                "target_hidden_size": c.target_hidden_size or c.hidden_size, "tie_word_embeddings": False,
                "torch_dtype": str(self.fc.weight.dtype).removeprefix("torch."),
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
                                 "use_aux_hidden_state": True}}

    @classmethod
    def config_from_official(cls, config: dict[str, Any], target_layers: int) -> dict[str, Any]:
        """This model's config from an official config.json (`target_layers`: the target's decoder layers, for the
        default fused layers when the config names none); InputError for a head this model does not run."""
        check(config.get("num_hidden_layers", 1) == 1, f"an EAGLE-3 head of {config.get('num_hidden_layers')} "
                                                       "layers; mmspec runs the official one-layer head.")
        eagle = config.get("eagle_config") or {}
        check(eagle.get("use_aux_hidden_state", True), "this EAGLE head reads one feature, not EAGLE-3's three "
                                                       "fused layers; load it as an EAGLE drafter.")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target_layers)
        rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return dict(hidden_size=config["hidden_size"], num_attention_heads=config["num_attention_heads"],
                    num_key_value_heads=config.get("num_key_value_heads"),
                    intermediate_size=config["intermediate_size"], rms_norm_eps=config.get("rms_norm_eps", 1e-6),
                    rope_theta=float(rope), max_position_embeddings=config.get("max_position_embeddings", 4096),
                    vocab_size=config["vocab_size"], draft_vocab_size=config.get("draft_vocab_size"),
                    target_hidden_size=config.get("target_hidden_size"), aux_layer_ids=tuple(ids))


# ---------------------------------------------------------------------------------------------- training
def draft_vocabulary(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` target tokens most frequent in training data (counts [V]; ties to the lower id), increasing: the
    draft vocabulary EAGLE-3's heads carry (`Eagle3Drafter.set_draft_vocabulary`)."""
    check(0 < size <= counts.numel(), f"a draft vocabulary of {size} tokens from a vocabulary of {counts.numel()}.")
    order = torch.argsort(-counts.double() + torch.arange(counts.numel()) / (counts.numel() + 1.0))
    return order[:size].sort().values


def ttt_attention_mask(valid: torch.Tensor, step: int) -> torch.Tensor:
    """[R, S, (step + 1) S] bool: what TTT step `step`'s elements see of the steps 0..step concatenated (valid [R, S]
    marks real elements): step 0's elements up to their own index, and steps 1..step at their own index alone (see
    the module docstring)."""
    r, s = valid.shape
    causal = torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(s, dtype=torch.bool, device=valid.device)
    mask = torch.cat([causal, *[eye] * step], dim=1)  # [S, (step + 1) S]
    return mask.unsqueeze(0) & valid.repeat(1, step + 1).unsqueeze(1)  # [R, S, (step + 1) S]


def shifted(x: torch.Tensor, k: int, fill: float | bool = 0) -> torch.Tensor:
    """x [R, S, ...] moved k elements left along S (element i holds x[i + k]), the last k filled."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], dim=1)


def ttt_loss(drafter: Eagle3Drafter, embeds: torch.Tensor, aux: torch.Tensor, target_logits: torch.Tensor,
             mask: torch.Tensor, steps: int = TTT_STEPS, decay: float = DECAY, valid: torch.Tensor | None = None,
             positions: torch.Tensor | None = None, direct: torch.Tensor | None = None,
             later_features: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """EAGLE-3's training-time-test loss over pairs i = 0..S-1: embeds e_{i+1} [R, S, H] (the next token's),
    aux a_i [R, S, 3 H_t], target_logits [R, S, V] (the target's at position i + 1: its distribution of token i + 2),
    mask [R, S] bool (the pairs that count), valid [R, S] (real elements; default all). Step k scores the drafter's
    distribution of token i + 2 + k against the target's, restricted to the draft vocabulary (positions whose target
    token lies outside it do not count), weight decay^k. Each step runs its S elements through the layer once,
    attending to the keys and values the earlier steps kept (with their gradients). A compressed layout (ViSpec's
    adaptor) gives its elements' positions [R, S] (default i + 1; step k's element i sits at element i + k's), the
    `direct` [R, S] elements of step 0 (`Eagle3Drafter.fuse`) and `later_features`, applied to the drafter's outputs
    before the next step reads them (as its loop applies them to the outputs it drafts from). Returns (loss, step 0's
    soft CE, the steps' mean soft CE, step 0's top-1 agreement), the last three detached."""
    from mmspec.attention import attend
    from mmspec.draft_layers import finish_module_layer, rope_rotation, rotate_together

    r, s, _ = embeds.shape
    valid = torch.ones(r, s, dtype=torch.bool, device=embeds.device) if valid is None else valid
    layer = drafter.layers[0]
    attn = layer.self_attn
    heads, kv_heads = attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim
    if positions is None:
        positions = torch.arange(1, s + 1, device=embeds.device).expand(r, s)  # [R, S] pair i at position i + 1
    draft_ids = drafter.draft_to_target  # [V_d]
    keys, values, hidden, total, ces, agree0 = [], [], aux, 0.0, [], None
    for k in range(steps):
        x = drafter.fuse(shifted(embeds, k), hidden, direct if k == 0 else None)  # [R, S, 2H]
        at = torch.cat([positions[:, k:], positions[:, -1:] + torch.arange(1, k + 1, device=positions.device)],
                       dim=1)  # [R, S] element i + k's position (past the end: one more each)
        cos, signed_sin = (t.unsqueeze(1) for t in rope_rotation(drafter.rotary_emb, x, at))
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(r, s, heads, attn.head_dim).transpose(1, 2)  # [R, Hq, S, D]
        key = attn.k_proj(h).view(r, s, kv_heads, attn.head_dim).transpose(1, 2)  # [R, Hkv, S, D]
        q, key = rotate_together(q, key, cos, signed_sin)
        keys.append(key)
        values.append(attn.v_proj(h).view(r, s, kv_heads, attn.head_dim).transpose(1, 2))
        out = attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), ttt_attention_mask(valid, k),
                     backend=drafter.attention_backend, scale=attn.scaling)  # [R, Hq, S, D]
        hidden = finish_module_layer(layer, x, out)  # [R, S, H] step k's outputs o
        logp = torch.log_softmax(drafter.draft_logits(hidden), dim=-1)  # [R, S, V_d]
        if later_features is not None:
            hidden = later_features(hidden)
        target = shifted(target_logits, k).float()  # [R, S, V]
        p = torch.softmax(target[..., draft_ids], dim=-1)  # [R, S, V_d]
        keep = shifted(mask, k, False) & drafter.t2d[target.argmax(-1)]  # [R, S]
        weight = keep.float() / keep.float().sum().clamp_min(1.0)
        ce = (-(p * logp).sum(-1) * weight).sum()
        total = total + decay ** k * ce
        ces.append(ce.detach())
        if k == 0:
            agree0 = ((logp.argmax(-1) == p.argmax(-1)).float() * weight).sum().detach()
    return total, ces[0], torch.stack(ces).mean(), agree0
