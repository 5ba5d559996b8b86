"""Lumina-mGPT (`image_ar.transformers_ar.lumina_*`): the target, its layout and CFG against a full-forward greedy
reference written from the official solver's facts, the converter of official folders (fork-layout weights and a
taming VQGAN checkpoint) and, when an extracted copy of the official repository is named by
$MMSPEC_LUMINA_MGPT_REPO (its `lumina_mgpt` folder), the official model classes themselves.

The always-running converter test makes a synthetic official folder: a transformers Chameleon whose q/k-norm rows
are equal within each of two model-parallel shards, written in the fork's layout ([shards, head_dim] rows, config
with `mask_image_logits: false`, the XLLMX class name), and a Lightning-style VQGAN file whose encoder and quantizer
are transformers' `ChameleonVQVAE` (the library's own modules, taming names) and whose decoder is the independent
taming reference below; the discriminator's `loss.*` weights ride along, as in Meta's file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from vq_reference import RefAttn, RefRes, RefUp, gn, swish, taming_names

from image_ar.transformers_ar.chameleon_vqgan import load_chameleon_vqgan
from image_ar.transformers_ar.lumina_convert import convert_lumina_mgpt
from image_ar.transformers_ar.lumina_mgpt import PROMPT, SEPARATOR, latent_grid, layout_length
from image_ar.transformers_ar.lumina_pipeline import LuminaMGPTPipeline
from image_ar.transformers_ar.tiny import tiny_lumina_mgpt_pipeline
from mmspec.errors import InputError

PROMPTS = ["a red circle", "two small blue squares on a green background"]  # ragged once tokenized
GUIDANCE = 3.0


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_lumina_mgpt_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe2():
    """Lumina-mGPT 2.0's shape: `<MOVQGAN*` image tokens, a MoVQGAN (8 pixels a code), 32 x 32 pixels."""
    pipe = tiny_lumina_mgpt_pipeline(version=2)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ------------------------------------------------------------------------ full-forward greedy reference
def reference_greedy(forward, pipe, prompt: str, height: int, width: int, guidance: float) -> list[int]:
    """The official solver's greedy image, written from its facts: the prompt ids (BOS, request text, separator)
    and the image header; each step the conditional logits of the whole sequence and the unconditional ones of the
    header + generated tokens (no text), u + g (c - u) on raw logits, then the layout (row end, `<eoss>` at the
    end, image tokens elsewhere) and the argmax. `forward(ids [1, L]) -> logits [1, L, V]` (unmasked)."""
    tok = pipe.processor
    ids = lambda name: tok.convert_tokens_to_ids(name)  # noqa: E731
    header = [ids("<racm3:break>"), ids(f"<reserved{8800 + height // 32:05d}>"),
              ids(f"<reserved{8800 + width // 32:05d}>")]
    text = tok.encode(PROMPT.format(width=width, height=height, prompt=prompt) + SEPARATOR, add_special_tokens=False)
    cond = [tok.bos_token_id, *text, *header]
    uncond = list(header)
    per_unit = 32 // pipe.vqgan.downsample_factor  # codes a 32-pixel side: 2 (1.0's VQGAN), 4 (2.0's MoVQGAN)
    grid_h, grid_w = per_unit * height // 32, per_unit * width // 32
    image = sorted(v for k, v in tok.get_vocab().items() if k.startswith(("IMGIMG", "<MOVQGAN")))
    out = []
    for t in range(grid_h * (grid_w + 1) + 1):
        c = forward(torch.tensor([cond]))[0, -1].double()
        u = forward(torch.tensor([uncond]))[0, -1].double()
        scores = guidance * (c - u) + u
        allowed = torch.zeros_like(scores, dtype=torch.bool)
        if (t + 1) % (grid_w + 1) == 0:
            allowed[ids("<reserved08799>")] = True
        elif t == grid_h * (grid_w + 1):
            allowed[ids("<eoss>")] = True
        else:
            allowed[image] = True
        token = int(scores.masked_fill(~allowed, -float("inf")).argmax())
        out.append(token)
        cond.append(token)
        uncond.append(token)
    return out


def transformers_forward(model):
    """transformers' Chameleon modules without the forward's image-logit masking (Lumina-mGPT's checkpoints)."""
    return lambda ids: model.lm_head(model.model(input_ids=ids).last_hidden_state).float()


def test_greedy_equals_the_full_forward_reference_on_a_ragged_batch(pipe):
    out = pipe(PROMPTS, guidance_scale=GUIDANCE, temperature=0, output_type="latent")
    assert out.tokens.shape == (2, layout_length(*latent_grid(64, 64))) == (2, 21)
    forward = transformers_forward(pipe.model)
    for row, prompt in zip(out.tokens.tolist(), PROMPTS):
        assert row == reference_greedy(forward, pipe, prompt, 64, 64, GUIDANCE)


def test_the_34b_norm_layout_follows_the_reference_too():
    """Lumina-mGPT-34B (Chameleon-34B's `swin_norm`: norms after attention and MLP) through transformers' own
    `ChameleonSwinDecoderLayer`."""
    swin = tiny_lumina_mgpt_pipeline(swin_norm=True)
    swin.set_progress_bar_config(disable=True)
    assert type(swin.model.model.layers[0]).__name__ == "ChameleonSwinDecoderLayer"
    out = swin(PROMPTS[:1], guidance_scale=GUIDANCE, temperature=0, output_type="latent")
    assert out.tokens[0].tolist() == reference_greedy(transformers_forward(swin.model), swin, PROMPTS[0], 64, 64,
                                                      GUIDANCE)


def test_a_wide_image_and_its_decoding(pipe):
    out = pipe("a cross", height=32, width=96, guidance_scale=GUIDANCE, temperature=0, output_type="latent")
    tokens = out.tokens[0].tolist()
    assert tokens == reference_greedy(transformers_forward(pipe.model), pipe, "a cross", 32, 96, GUIDANCE)
    images = pipe.decode(out.tokens)
    assert images.shape == (1, 3, 32, 96)
    codes = pipe.codes(out.tokens)  # [1, 2, 6]: the row ends and <eoss> dropped, BPE ids -> VQ codes
    mapping = pipe.model.model.vocabulary_mapping.bpe2img
    rows = [tokens[r * 7: r * 7 + 6] for r in range(2)]
    assert codes[0].tolist() == [[mapping[t] for t in row] for row in rows]
    expected = ((pipe.vqgan.decode_code(codes).clamp(-1, 1) + 1) / 2)
    torch.testing.assert_close(images, expected)


def test_input_ids_of_the_conversation_and_images_per_prompt(pipe):
    """input_ids as the official item processor tokenizes the conversation (BOS, text, separator; here left padded)
    get the image header appended: the prompt path's tokens; num_images_per_prompt repeats each prompt's rows."""
    base = pipe(PROMPTS, guidance_scale=GUIDANCE, temperature=0, output_type="latent", num_images_per_prompt=2)
    tok = pipe.processor
    texts = [PROMPT.format(width=64, height=64, prompt=p) + SEPARATOR for p in PROMPTS]
    rows = [[tok.bos_token_id, *tok.encode(t, add_special_tokens=False)] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    assert (mask == 0).any()  # ragged: the left padding is exercised
    out = pipe(input_ids=ids, attention_mask=mask, guidance_scale=GUIDANCE, temperature=0, output_type="latent")
    assert torch.equal(out.tokens, base.tokens[::2]) and torch.equal(base.tokens[::2], base.tokens[1::2])


def test_methods_are_greedy_exact_in_fewer_forwards(pipe):
    base = pipe(PROMPTS, guidance_scale=GUIDANCE, temperature=0, output_type="latent")
    for method, kwargs in (("sjd", {}), ("gsd", {}), ("sjd", {"accept": "lantern", "delta": 0.0})):
        out = pipe(PROMPTS, guidance_scale=GUIDANCE, temperature=0, method=method, method_kwargs=kwargs,
                   budget="fixed", output_type="latent")
        assert torch.equal(out.tokens, base.tokens), (method, kwargs)
        assert out.stats.num_target_forwards <= base.stats.num_target_forwards, (method, kwargs)


def test_the_drafter_trainer_samples_at_each_versions_top_k(pipe, pipe2):
    from image_ar.transformers_ar.train_eagle import family_top_k

    assert (family_top_k(pipe), family_top_k(pipe2)) == (2000, 4096)  # 1.0's README, 2.0's sample script


def test_lumina_mgpt_2_greedy_reference_decoding_and_methods(pipe2):
    assert (pipe2.version, pipe2.codes_per_unit, pipe2.default_top_k, pipe2.default_image_size) == (2, 4, 4096, 32)
    out = pipe2(PROMPTS, guidance_scale=GUIDANCE, temperature=0, output_type="latent")
    forward = transformers_forward(pipe2.model)
    for row, prompt in zip(out.tokens.tolist(), PROMPTS):
        assert row == reference_greedy(forward, pipe2, prompt, 32, 32, GUIDANCE)
    vocab = pipe2.processor.get_vocab()
    first = vocab["<MOVQGAN00000>"]
    cells = out.tokens[:, :20].reshape(2, 4, 5)[..., :4]
    assert torch.equal(pipe2.codes(out.tokens), cells - first)  # the official decode: token id - the first image id
    images = pipe2.decode(out.tokens)
    assert images.shape == (2, 3, 32, 32)
    torch.testing.assert_close(images, (pipe2.vqgan.decode_code(cells - first).clamp(-1, 1) + 1) / 2)
    sjd = pipe2(PROMPTS, guidance_scale=GUIDANCE, temperature=0, method="sjd", budget="fixed", output_type="latent")
    assert torch.equal(sjd.tokens, out.tokens) and sjd.stats.num_target_forwards <= out.stats.num_target_forwards


def test_bad_sizes_and_inputs_are_one_line_errors(pipe):
    with pytest.raises(InputError, match="multiple of 32"):
        pipe("a cross", height=48)
    with pytest.raises(InputError, match="grid token|<reserved08805>"):
        pipe("a cross", height=160)  # the tiny tokenizer names sides of 1-4 units only
    with pytest.raises(InputError, match="class_labels"):
        pipe(class_labels=[1])
    from image_ar.transformers_ar.official import with_eagle_drafter

    with pytest.raises(InputError, match="accept='capped' verifies chains only"):  # before any forward
        with_eagle_drafter(tiny_lumina_mgpt_pipeline(), "cpu", torch.float32)(
            "a cross", method="eagle", method_kwargs={"accept": "capped"})


# ------------------------------------------------------------------------------- the official layout
class TamingDecoder(nn.Module):
    """taming's `Decoder` with `attn_resolutions: []` (Chameleon's), under its own names: conv_in, mid.block_1 /
    attn_1 / block_2, up.{level}.block.{j} (+ upsample above level 0; level 0 is the full resolution), norm_out,
    conv_out."""

    def __init__(self, ch: int, ch_mult: tuple[int, ...], n_res: int, z: int, groups: int = 32):
        super().__init__()
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z, block_in, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1, self.mid.attn_1 = RefRes(block_in, block_in, groups), RefAttn(block_in, groups)
        self.mid.block_2 = RefRes(block_in, block_in, groups)
        ups: list[nn.Module] = [nn.Module() for _ in ch_mult]
        for level in reversed(range(len(ch_mult))):
            out = ch * ch_mult[level]
            ups[level].block = nn.ModuleList([RefRes(block_in if j == 0 else out, out, groups)
                                              for j in range(n_res + 1)])
            if level != 0:
                ups[level].upsample = RefUp(out)
            block_in = out
        self.up = nn.ModuleList(ups)
        self.norm_out, self.conv_out = gn(block_in, groups), nn.Conv2d(block_in, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for level in reversed(range(len(self.up))):
            for block in self.up[level].block:
                h = block(h)
            if level != 0:
                h = self.up[level].upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


def official_vqgan_file(pipe, path: Path) -> tuple[dict, TamingDecoder]:
    """A Lightning-style VQGAN file in Meta's layout: transformers' ChameleonVQVAE (encoder, quantizer, quant convs)
    + the taming reference decoder + a discriminator weight, under `state_dict`."""
    torch.manual_seed(3)
    vq = pipe.model.model.vqmodel
    cfg = pipe.model.config.vq_config
    decoder = TamingDecoder(cfg.base_channels, tuple(cfg.channel_multiplier), cfg.num_res_blocks,
                            cfg.latent_channels).eval()
    with torch.no_grad():
        for p in (*vq.parameters(), *decoder.parameters()):
            p.add_(0.05 * torch.randn_like(p))  # off the default affines and biases, so a swapped key would show
    sd = {**vq.state_dict(), **{f"decoder.{k}": v for k, v in decoder.state_dict().items()},
          "loss.discriminator.main.0.weight": torch.randn(4, 3, 4, 4)}
    torch.save({"state_dict": sd, "global_step": 7}, path)
    return sd, decoder


def official_folder(pipe, folder: Path) -> None:
    """The tiny model written as an official Lumina-mGPT folder: q/k-norm rows per model-parallel shard (2 shards),
    the fork's config fields, no image encoder weights, the tokenizer files."""
    model = pipe.model
    heads = {"q": model.config.num_attention_heads, "k": model.config.num_key_value_heads}
    with torch.no_grad():  # equal rows within each shard: what the fork's repeat_interleave computes
        for layer in model.model.layers:
            for name, n in heads.items():
                norm = getattr(layer.self_attn, f"{name}_norm")
                for p in norm.parameters():
                    p.copy_(p[:: n // 2].repeat_interleave(n // 2, dim=0))
    pipe.save_pretrained(folder)
    sd = {}
    for shard in folder.glob("*.safetensors"):
        sd.update(load_file(str(shard)))
        shard.unlink()
    for extra in ("model.safetensors.index.json",):
        (folder / extra).unlink(missing_ok=True)
    sd = {k: v for k, v in sd.items() if not k.startswith("model.vqmodel.")}
    for key in [k for k in sd if "_norm." in k and ".self_attn." in k]:
        n = heads[key.split(".self_attn.")[1][0]]
        sd[key] = sd[key][:: n // 2].contiguous()  # [2, head_dim]: one row per shard
    sd["lm_head.weight"] = sd.get("lm_head.weight", model.lm_head.weight.detach().clone())
    save_file(sd, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config.pop("lumina_mgpt")
    config.update(mask_image_logits=False, z_loss_weight=1e-5, model_parallel_size=2,
                  architectures=["ChameleonXLLMXForConditionalGeneration"])
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def converted(pipe, tmp_path_factory):
    root = tmp_path_factory.mktemp("lumina")
    official = root / "Lumina-mGPT-tiny-64"
    official_folder(pipe, official)
    vq_sd, decoder = official_vqgan_file(pipe, root / "vqgan.ckpt")
    with pytest.raises(InputError, match="official Lumina-mGPT folder: convert it once"):
        LuminaMGPTPipeline.from_pretrained(official)
    assert load_chameleon_vqgan(root / "vqgan.ckpt").config.level_attention is False  # safe loading reads it
    convert_lumina_mgpt(official, root / "vqgan.ckpt", root / "converted", image_size=64)
    loaded = LuminaMGPTPipeline.from_pretrained(root / "converted")
    loaded.set_progress_bar_config(disable=True)
    return loaded, vq_sd, decoder


def test_the_converted_folder_runs_the_same_model(pipe, converted):
    loaded, _, _ = converted
    ids = torch.randint(0, pipe.lm.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(transformers_forward(loaded.model)(ids), transformers_forward(pipe.model)(ids),
                               rtol=0, atol=0)
    assert loaded.default_image_size == 64
    a = pipe(PROMPTS, guidance_scale=GUIDANCE, temperature=0, output_type="latent").tokens
    assert torch.equal(loaded(PROMPTS, guidance_scale=GUIDANCE, temperature=0, output_type="latent").tokens, a)


def test_the_converted_vqgan_equals_the_official_modules(converted):
    loaded, vq_sd, decoder = converted
    from transformers import ChameleonVQVAE

    official = ChameleonVQVAE(loaded.model.config.vq_config).eval()
    official.load_state_dict({k: v for k, v in vq_sd.items() if not k.startswith(("decoder.", "loss."))})
    images = torch.rand(2, 3, 64, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        ids = official.encode(images).image_tokens.view(2, 4, 2)  # transformers' encoder and quantizer
        assert torch.equal(loaded.vqgan.encode(images).ids, ids)
        z = official.post_quant_conv(official.quantize.embedding(ids).permute(0, 3, 1, 2))
        torch.testing.assert_close(loaded.vqgan.decode_code(ids), decoder(z), rtol=1e-4, atol=1e-5)
    converted_sd = load_file(str(Path(loaded.model.config._name_or_path) / "model-00002-of-00002.safetensors"))
    assert set(converted_sd) == {f"model.vqmodel.{k}" for k in official.state_dict()}


@pytest.fixture(scope="module")
def converted2(pipe, pipe2, tmp_path_factory):
    """A synthetic official Lumina-mGPT 2.0 folder (`Lumina-mGPT-2.0`) and MoVQGAN file, converted and loaded."""
    root = tmp_path_factory.mktemp("lumina2")
    official_folder(pipe2, root / "Lumina-mGPT-2.0")
    # (MoVQGAN's converter itself is proven against an independent reference in test_movqgan.py)
    movq_sd = taming_names(pipe2.vqgan.state_dict(), len(pipe2.vqgan.config.ch_mult))
    torch.save(movq_sd, root / "movqgan_270M.ckpt")
    torch.save({"state_dict": taming_names(pipe.vqgan.state_dict(), 5)}, root / "vqgan.ckpt")
    with pytest.raises(InputError, match="is a Chameleon VQGAN checkpoint, but Lumina-mGPT-2.0 is Lumina-mGPT 2.0"):
        convert_lumina_mgpt(root / "Lumina-mGPT-2.0", root / "vqgan.ckpt", root / "out", image_size=32)
    convert_lumina_mgpt(root / "Lumina-mGPT-2.0", root / "movqgan_270M.ckpt", root / "converted", image_size=32)
    loaded = LuminaMGPTPipeline.from_pretrained(root / "converted")
    loaded.set_progress_bar_config(disable=True)
    return loaded, movq_sd


def test_a_lumina_mgpt_2_folder_converts_with_its_movqgan(pipe2, converted2):
    loaded, _ = converted2
    config = json.loads((Path(loaded.model.config._name_or_path) / "config.json").read_text())
    assert config["lumina_mgpt"] == {"image_size": 32, "version": 2} and "mask_image_logits" not in config
    assert loaded.version == 2 and not hasattr(loaded.model.model, "vqmodel")
    expected = pipe2(PROMPTS, guidance_scale=GUIDANCE, temperature=0, output_type="latent").tokens
    out = loaded(PROMPTS, guidance_scale=GUIDANCE, temperature=0, output_type="pt")
    assert torch.equal(out.tokens, expected)
    torch.testing.assert_close(out.images, pipe2.decode(expected), rtol=0, atol=0)


def test_converter_refusals(pipe, tmp_path):
    official = tmp_path / "Lumina-mGPT-x"
    official.mkdir()
    (official / "config.json").write_text(json.dumps({"model_type": "chameleon", "mask_image_logits": True}))
    with pytest.raises(InputError, match="mask_image_logits true"):
        convert_lumina_mgpt(official, tmp_path / "v.ckpt", tmp_path / "out", image_size=64)
    with pytest.raises(InputError, match="--image-size"):
        convert_lumina_mgpt(official, tmp_path / "v.ckpt", tmp_path / "out")
    (official / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(InputError, match="model_type is 'llama'"):
        convert_lumina_mgpt(official, tmp_path / "v.ckpt", tmp_path / "out", image_size=64)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------- the official code, when extracted
def official_repo(variable: str) -> Path | None:
    found = os.environ.get(variable)
    return Path(found) if found and (Path(found) / "model" / "chameleon").is_dir() else None


def fork_model(repo: Path, folder: Path):
    """The official fork's `ChameleonForConditionalGeneration` with the official folder's weights (its config as
    the fork reads it; the image encoder's weights are not in the folder)."""
    sys.path.insert(0, str(repo))
    try:
        from model.chameleon import ChameleonConfig, ChameleonForConditionalGeneration
    finally:
        sys.path.pop(0)
    config = ChameleonConfig(**{k: v for k, v in json.loads((folder / "config.json").read_text()).items()
                                if k not in ("architectures", "z_loss_weight", "rope_parameters")})
    config.rope_scaling = None  # (the fork reads rope_scaling["type"]; transformers 5 standardises the field)
    config._attn_implementation = "eager"
    fork = ChameleonForConditionalGeneration(config).eval()
    missing, unexpected = fork.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    assert not unexpected and all(k.startswith("model.vqmodel.") for k in missing)
    for name in [m for m in sys.modules if m == "model" or m.startswith("model.")]:
        del sys.modules[name]  # (both versions' folders are named `model`)
    return lambda ids: fork(input_ids=ids).logits.float()


def check_logits_and_tokens(fork_forward, loaded, size: int) -> torch.Tensor:
    ids = torch.randint(0, loaded.lm.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(transformers_forward(loaded.model)(ids), fork_forward(ids), rtol=1e-5, atol=1e-5)
    out = loaded(PROMPTS, guidance_scale=GUIDANCE, temperature=0, output_type="latent")
    for row, prompt in zip(out.tokens.tolist(), PROMPTS):
        assert row == reference_greedy(fork_forward, loaded, prompt, size, size, GUIDANCE)
    return out.tokens


@pytest.mark.skipif(official_repo("MMSPEC_LUMINA_MGPT_REPO") is None,
                    reason="set MMSPEC_LUMINA_MGPT_REPO to an extracted Alpha-VLLM/Lumina-mGPT `lumina_mgpt` folder "
                           "to run its own classes")
def test_the_official_classes_give_the_same_logits_tokens_and_images(converted):
    repo = official_repo("MMSPEC_LUMINA_MGPT_REPO")
    loaded, vq_sd, _ = converted
    forward = fork_model(repo, Path(loaded.model.config._name_or_path).parent / "Lumina-mGPT-tiny-64")
    tokens = check_logits_and_tokens(forward, loaded, 64)
    sys.path.insert(0, str(repo))
    try:
        from model.chameleon_vae_ori.vqgan import VQModel
    finally:
        sys.path.pop(0)
    cfg = loaded.model.config.vq_config
    ddconfig = dict(ch=cfg.base_channels, out_ch=3, ch_mult=list(cfg.channel_multiplier),
                    num_res_blocks=cfg.num_res_blocks, attn_resolutions=[], in_channels=3, resolution=64,
                    z_channels=cfg.latent_channels, double_z=False, dropout=0.0)
    vqmodel = VQModel(ddconfig, cfg.num_embeddings, cfg.embed_dim).eval()
    vqmodel.load_state_dict({k: v for k, v in vq_sd.items() if not k.startswith("loss.")})
    codes = loaded.codes(tokens)  # [2, 4, 4]
    with torch.no_grad():
        quant = vqmodel.quantize.get_codebook_entry(codes.reshape(-1), (2, 4, 4, cfg.embed_dim))
        official = ((vqmodel.decode(quant).clamp(-1, 1) + 1) / 2)
    torch.testing.assert_close(loaded.decode(tokens), official, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(official_repo("MMSPEC_LUMINA_MGPT2_REPO") is None,
                    reason="set MMSPEC_LUMINA_MGPT2_REPO to an extracted Alpha-VLLM/Lumina-mGPT-2.0 `lumina_mgpt` "
                           "folder to run its own classes")
def test_the_official_2_0_classes_give_the_same_logits_tokens_and_images(converted2):
    repo = official_repo("MMSPEC_LUMINA_MGPT2_REPO")
    loaded, movq_sd = converted2
    forward = fork_model(repo, Path(loaded.model.config._name_or_path).parent / "Lumina-mGPT-2.0")
    tokens = check_logits_and_tokens(forward, loaded, 32)
    path = repo / "movqgan" / "modules" / "vqvae" / "movq_modules.py"  # the file alone: the package needs lightning
    spec = importlib.util.spec_from_file_location("official_movq_modules", path)
    movq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(movq)
    cfg = loaded.vqgan.config
    decoder = movq.MOVQDecoder(ch=cfg.ch, out_ch=3, ch_mult=list(cfg.ch_mult), num_res_blocks=cfg.num_res_blocks,
                               attn_resolutions=[32], in_channels=3, resolution=32 * 2 ** (len(cfg.ch_mult) - 1),
                               z_channels=cfg.z_channels, zq_ch=cfg.codebook_embed_dim).eval()
    decoder.load_state_dict({k[len("decoder."):]: v for k, v in movq_sd.items() if k.startswith("decoder.")})
    codes = loaded.codes(tokens)  # [2, 4, 4]
    with torch.no_grad():  # the official decode_code: embedding, post_quant_conv, decoder(quant2, quant)
        zq = movq_sd["quantize.embedding.weight"][codes].permute(0, 3, 1, 2)
        quant2 = torch.nn.functional.conv2d(zq, movq_sd["post_quant_conv.weight"], movq_sd["post_quant_conv.bias"])
        official = (decoder(quant2, zq).clamp(-1, 1) + 1) / 2
    torch.testing.assert_close(loaded.decode(tokens), official, rtol=1e-4, atol=1e-5)
