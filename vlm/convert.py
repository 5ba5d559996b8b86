"""Official EAGLE-format VLM drafters -> mmspec drafters (`load_official_drafter`; `mmspec convert vlm-drafter`),
and mmspec's EAGLE-3 drafters -> the official EAGLE-3 layout vLLM and SGLang serve (`export_official_eagle3`).

    mmspec convert vlm-drafter --drafter MSD-LLaVA1.5-7B --kind msd --target llava-1.5-7b-hf --out msd-drafter
    mmspec convert vlm-drafter --drafter EAGLE3-head --kind eagle3 --target Qwen2.5-VL-7B --out eagle3-drafter
    mmspec convert vlm-drafter --to-official --drafter TARGET/drafters/eagle3 --kind eagle3 --target TARGET --out H

The official layout (SafeAILab/EAGLE `cnets.py`, which MSD ships unchanged; ViSpec adds two modules) is an HF
Llama-style folder: `config.json` (hidden_size, num_attention_heads, num_key_value_heads, intermediate_size,
rms_norm_eps, rope_theta, max_position_embeddings, vocab_size) and `model.safetensors` or `pytorch_model.bin`:

| official key                                         | mmspec module (`vlm.eagle.VLMEagleDrafter`)        |
|------------------------------------------------------|----------------------------------------------------|
| `fc.weight`, `fc.bias`                               | the same (no `fc.bias`: `fc_bias=False`)           |
| `layers.0.self_attn.{q,k,v,o}_proj.weight`           | the same (a transformers `LlamaDecoderLayer`)      |
| `layers.0.mlp.{gate,up,down}_proj.weight`            | the same                                           |
| `layers.0.post_attention_layernorm.weight`           | the same                                           |
| `layers.0.input_layernorm.weight` (absent in EAGLE)  | present: `input_norm=True`; absent: no input norm  |
| `embed_tokens.weight`                                | not kept: must equal the target's token embeddings |
| ViSpec: `imadpt.q`, `imadpt.{k,v,o}_proj.*`, `img_fc.*` | the same (`vlm.vispec.VLMViSpecDrafter`)         |

EAGLE-3 heads (`--kind eagle3`, `vlm.eagle3.VLMEagle3Drafter`, key layout in `mmspec.eagle3`): `config.json` of
architecture `LlamaForCausalLMEagle3` (or `Eagle3LlamaForCausalLM`) with `draft_vocab_size`, `target_hidden_size`
and `eagle_config.eagle_aux_hidden_state_layer_ids` (absent: the official 2, L // 2, L - 3 of the target's L layers),
weights `fc.weight` (no bias), `midlayer.*` (vLLM's `layers.0.*` spelling read too), `norm.weight`, `lm_head.weight`,
`d2t`, `t2d`; `--to-official` writes that layout (config.json + model.safetensors) from an mmspec eagle3 drafter.

Loading is strict: a missing or unexpected key, a shape that does not fit, more than one decoder layer or an
embedding table other than the target's is an `InputError` naming it (never a silently fresh all-ones norm).
`pytorch_model.bin` is read with weights-only loading (`mmspec.checkpoints.load_checkpoint`; `allow_pickle=True`
for full pickle of a trusted file). The drafter then computes what the official code computes: the same modules,
the target's LM head, its positions shifted by one (RoPE only sees differences), MSD's raw visual embeddings at
image positions when loaded as `kind="msd"`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mmspec.checkpoints import load_checkpoint
from mmspec.data.artifacts import atomic_output_dir
from mmspec.errors import InputError, check
from vlm.family import drafter_model
from vlm.target import CachedVLM

OFFICIAL_KINDS = ("eagle", "msd", "vispec", "eagle3")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
CONFIG_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
               "max_position_embeddings", "vocab_size")


def official_weights(folder: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    """The folder's tensors: `model.safetensors` (or safetensors shards), else `pytorch_model.bin`."""
    if any(folder.glob("*.safetensors")):
        return load_checkpoint(folder)
    for name in ("pytorch_model.bin", "model.bin"):
        if (folder / name).is_file():
            state = load_checkpoint(folder / name, allow_pickle=allow_pickle)
            check(isinstance(state, dict), f"{folder / name} does not hold a state dict of tensors.")
            return state
    raise InputError(f"{folder} holds no model.safetensors or pytorch_model.bin; point --drafter at the official "
                     "drafter folder.")


def official_config(folder: Path, state: dict[str, torch.Tensor], kind: str) -> dict:
    """mmspec drafter config from the official config.json and the keys present."""
    path = folder / "config.json"
    check(path.is_file(), f"{path} is missing; an official drafter folder has an HF Llama-style config.json.")
    raw = json.loads(path.read_text())
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in raw]
    check(not missing, f"{path} lacks {', '.join(missing)}; is this an EAGLE-format drafter config?")
    check(int(raw.get("num_hidden_layers", 1)) == 1 and not any(k.startswith("layers.1.") for k in state),
          f"{folder} has {raw.get('num_hidden_layers')} decoder layers; mmspec's VLM drafters have one (EAGLE-1/2).")
    config = {k: raw[k] for k in CONFIG_KEYS if k in raw}
    theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    config.update(rope_theta=float(theta), fc_bias="fc.bias" in state,
                  input_norm="layers.0.input_layernorm.weight" in state)
    scaling = raw.get("rope_scaling")
    check(not scaling, f"{path} sets rope_scaling {scaling}; mmspec's drafter layer uses plain RoPE.")
    if kind == "vispec":
        q = state.get("imadpt.q")
        check(q is not None, f"{folder} has no imadpt.q: not a ViSpec drafter; load it as kind eagle or msd.")
        check(q.dim() == 3 and q.shape[1] == raw["num_attention_heads"],
              f"imadpt.q has shape {list(q.shape)}, expected [num_q, {raw['num_attention_heads']}, head_dim].")
        config.update(num_queries=int(q.shape[0]), qkv_bias="imadpt.k_proj.bias" in state)
    else:
        check(not any(k.startswith(("imadpt.", "img_fc.")) for k in state),
              f"{folder} holds ViSpec modules (imadpt, img_fc); load it with kind vispec.")
    return config


def official_eagle3_config(folder: Path, target: CachedVLM) -> dict:
    """mmspec `Eagle3Drafter` config from an official EAGLE-3 head's config.json (see the module docstring)."""
    path = folder / "config.json"
    check(path.is_file(), f"{path} is missing; an official EAGLE-3 head has an HF Llama-style config.json.")
    raw = json.loads(path.read_text())
    arch = (raw.get("architectures") or ["?"])[0]
    check(arch in EAGLE3_ARCHITECTURES, f"{path} names architecture {arch}, not an EAGLE-3 head "
                                        f"({' or '.join(EAGLE3_ARCHITECTURES)}); load EAGLE-1/2 heads as kind eagle.")
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in raw]
    check(not missing, f"{path} lacks {', '.join(missing)}.")
    check(not raw.get("rope_scaling"), f"{path} sets rope_scaling {raw.get('rope_scaling')}; mmspec's drafter "
                                       "layer uses plain RoPE.")
    layers = target.model.config.text_config.num_hidden_layers
    return drafter_model("eagle3").config_from_official(raw, layers)


def export_official_eagle3(drafter, out: str | Path) -> Path:
    """Write an mmspec eagle3 drafter in the official EAGLE-3 layout (config.json + model.safetensors), atomically;
    InputError for one with the vision adaptor (the official format and the engines' loaders have none)."""
    from safetensors.torch import save_file

    check(not getattr(drafter, "vision_adaptor", False),
          "this EAGLE-3 drafter carries ViSpec's vision adaptor, which the official EAGLE-3 format (and vLLM's and "
          "SGLang's loaders) cannot hold; export a drafter trained without --vision-adaptor.")

    with atomic_output_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(drafter.official_config(), indent=2) + "\n")
        save_file({k: v.detach().cpu() for k, v in drafter.to_official_state().items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
    return Path(out)


def load_official_drafter(folder: str | Path, target: CachedVLM, kind: str, allow_pickle: bool = False):
    """An official EAGLE / MSD / ViSpec drafter folder as the mmspec drafter of `kind`, attached to `target` (see
    the module docstring for the key layout and the checks)."""
    check(kind in OFFICIAL_KINDS, f"kind must be one of {', '.join(OFFICIAL_KINDS)} (official EAGLE-format "
                                  f"drafters), got {kind!r}.")
    folder = Path(folder)
    check(folder.is_dir(), f"{folder} is not a folder; give the official drafter's folder (config.json + weights).")
    state = dict(official_weights(folder, allow_pickle))
    if kind == "eagle3":
        config = official_eagle3_config(folder, target)
        state = drafter_model(kind).from_official_state(state)
        vocab = config["draft_vocab_size"] or config["vocab_size"]
        if "d2t" not in state and vocab == config["vocab_size"]:  # a head over the whole vocabulary may omit both
            state["d2t"] = torch.zeros(vocab, dtype=torch.long)
        if "t2d" not in state and "d2t" in state:  # vLLM reads d2t alone; t2d follows from it
            state["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool)
            state["t2d"][torch.arange(state["d2t"].numel()) + state["d2t"].long()] = True
    else:
        config = official_config(folder, state, kind)
    embed = state.pop("embed_tokens.weight", None)
    text_embed = target.model.get_input_embeddings().weight
    if embed is not None:
        same = embed.shape == text_embed.shape and torch.equal(embed.to(text_embed), text_embed.detach())
        check(same, f"{folder}'s embed_tokens differ from the target's token embeddings: the drafter was made for "
                    "another target.")
    drafter = drafter_model(kind)(**config)
    ours = drafter.state_dict()
    missing = sorted(set(ours) - set(state))
    unexpected = sorted(set(state) - set(ours))
    check(not missing, f"{folder} lacks {', '.join(missing)}; an official {kind} drafter has them.")
    check(not unexpected, f"{folder} has keys an official {kind} drafter does not: {', '.join(unexpected[:6])}.")
    wrong = [f"{k} {list(state[k].shape)} (expected {list(v.shape)})" for k, v in ours.items()
             if state[k].shape != v.shape]
    check(not wrong, f"{folder}: shapes do not fit its config: {'; '.join(wrong[:4])}.")
    drafter.load_state_dict({k: v.to(ours[k].dtype) for k, v in state.items()}, strict=True)
    w = target.model.lm_head.weight
    return drafter.to(device=w.device, dtype=w.dtype).eval().attach(target)


# ---------------------------------------------------------------------------------------------------- command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", required=True, help="official drafter folder (config.json + model.safetensors "
                                                         "or pytorch_model.bin)")
    parser.add_argument("--kind", required=True, choices=OFFICIAL_KINDS,
                        help="eagle (EAGLE / EagleVLM), msd (MSD: raw visual embeddings at image positions), "
                             "vispec (imadpt + img_fc) or eagle3 (an EAGLE-3 head: fc over three target layers, "
                             "its own head and draft vocabulary)")
    parser.add_argument("--target", required=True, help="the LLaVA target's folder (transformers format)")
    parser.add_argument("--out", required=True, help="mmspec drafter folder to write (e.g. TARGET/drafters/KIND)")
    parser.add_argument("--to-official", action="store_true",
                        help="the other way: --drafter is an mmspec eagle3 drafter folder, --out gets the official "
                             "EAGLE-3 layout (vLLM's and SGLang's EAGLE-3 loaders read it)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="load pytorch_model.bin with full pickle (runs code from it: only for files you trust)")


def run(args: argparse.Namespace) -> int:
    from vlm.pipeline import SpeculativeVLM

    if args.to_official:
        check(args.kind == "eagle3", "--to-official writes EAGLE-3 heads: give --kind eagle3.")
        vlm = SpeculativeVLM.from_pretrained(args.target, "eagle3", drafter_path=args.drafter)
        export_official_eagle3(vlm.drafter, args.out)
        print(f"wrote {args.out} (official EAGLE-3 layout)")
        return 0
    vlm = SpeculativeVLM.from_pretrained(args.target)
    drafter = load_official_drafter(args.drafter, vlm.lm, args.kind, allow_pickle=args.allow_pickle)
    with atomic_output_dir(args.out) as tmp:
        drafter.save_pretrained(tmp)
    print(f"wrote {args.out} ({args.kind} drafter, {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M "
          "parameters)")
    return 0
