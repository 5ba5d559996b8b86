"""transformers' Emu3 as a discrete image target (issue 26): a tiny random Emu3ForConditionalGeneration with its own
processor built offline (`image_ar.transformers_ar.tiny`). Greedy vanilla through mmspec == transformers'
`generate` with the `prefix_allowed_tokens_fn` of its documentation, with the official script's negative prompt and
image header (the default), the prompts' last tokens, or a plain-text negative prompt, on a ragged batch (same
tokens, same decoded images); sampled images keep the layout; the folder round
trip, the CLI and the one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch

from image_ar.transformers_ar.emu3 import EMU3_NEGATIVE_PROMPT, emu3_layout, layout_length
from image_ar.transformers_ar.pipeline import Emu3Pipeline
from image_ar.transformers_ar.tiny import tiny_emu3_pipeline
from mmspec.cli import main
from mmspec.errors import InputError
from mmspec.testing.pipeline_tester import PromptPipelineTesterMixin

PROMPTS = ["a red circle", "two small blue squares on a green background", "a cross"]  # ragged once tokenized
AREA = 32 * 32  # the tiny model's area: a 4 x 4 token grid


@pytest.fixture(scope="module")
def pipe() -> Emu3Pipeline:
    pipe = tiny_emu3_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


class TestEmu3Pipeline(PromptPipelineTesterMixin):
    pipeline_class = Emu3Pipeline
    image_shape, token_shape, prompts = (8, 8), (23,), tuple(PROMPTS)  # a 4 x 4 grid with its layout tokens
    steps_instead = r"fixed by the image size \(ratio and image_area"

    def get_dummy_components(self) -> dict:
        pipe = tiny_emu3_pipeline()
        return {"model": pipe.model, "processor": pipe.processor}


def documented_prefix_fn(pipe: Emu3Pipeline, height: int, width: int):
    """transformers' Emu3 documentation's prefix_allowed_tokens_fn, written out."""
    tok, mapping = pipe.processor.tokenizer, pipe.model.model.vocabulary_mapping
    wrapper = tok.convert_tokens_to_ids(tok.image_wrapper_token)

    def allowed(batch_id, input_ids):
        position = torch.nonzero(input_ids == wrapper, as_tuple=True)[0][0]
        offset = input_ids.shape[0] - position
        if offset % (width + 1) == 0:
            return (mapping.eol_token_id,)
        if offset == (width + 1) * height + 1:
            return (tok.convert_tokens_to_ids(tok.eof_token),)
        if offset == (width + 1) * height + 2:
            return (tok.convert_tokens_to_ids(tok.eoi_token),)
        if offset == (width + 1) * height + 3:
            return (tok.eos_token_id,)
        if offset > (width + 1) * height + 3:
            return (tok.pad_token_id,)
        return mapping.image_tokens

    return allowed


def transformers_tokens(pipe: Emu3Pipeline, negative: str | None = None, header: bool = True) -> torch.Tensor:
    """transformers' greedy `generate` with CFG 3 and the documented prefix function; the unconditional context is
    `negative` encoded as the official script does (`header`: its processor's mode 'G', the image header appended as
    to the prompt) or as plain text (transformers' documentation), or the prompts' last tokens (None)."""
    enc = pipe.processor(text=PROMPTS, return_for_image_generation=True, image_area=AREA, padding=True,
                         return_tensors="pt")
    assert (enc["attention_mask"] == 0).any()  # ragged: left padding is exercised
    height, width = enc.pop("image_sizes")[0]
    extra = {}
    if negative is not None:
        form = {"return_for_image_generation": True, "image_area": AREA} if header else {}
        neg = pipe.processor(text=[negative] * len(PROMPTS), return_tensors="pt", **form)
        extra = {"negative_prompt_ids": neg["input_ids"], "negative_prompt_attention_mask": neg["attention_mask"]}
    out = pipe.model.generate(**enc, max_new_tokens=layout_length(height, width), do_sample=False,
                              guidance_scale=3.0, prefix_allowed_tokens_fn=documented_prefix_fn(pipe, height, width),
                              **extra)
    return out[:, enc["input_ids"].shape[1]:]


@pytest.mark.parametrize("call, negative, header", [({}, EMU3_NEGATIVE_PROMPT, True),  # the default: the official
                                                     ({"negative_prompt": None}, None, True),
                                                     ({"negative_prompt": "blurry", "negative_header": False},
                                                      "blurry", False)])
def test_greedy_vanilla_equals_transformers_generation(pipe, call, negative, header):
    reference = transformers_tokens(pipe, negative, header)  # [3, 23]
    out = pipe(PROMPTS, temperature=0.0, output_type="pt", **call)  # (CFG 3.0: the default)
    assert torch.equal(out.tokens, reference)
    codes = reference[:, :-3].view(3, 4, 5)[..., :4]
    assert len(set(codes.flatten().tolist())) > 6  # varied codes: the comparison can fail
    images = ((pipe.model.decode_image_tokens(image_tokens=reference, height=4, width=4) + 1) / 2).clamp(0, 1)
    torch.testing.assert_close(out.images, images, atol=1e-5, rtol=0)


def test_the_negative_prompt_its_header_and_the_scale_change_the_image(pipe):
    default = pipe(PROMPTS, temperature=0.0, output_type="latent").tokens
    for call in ({"negative_prompt": None}, {"negative_prompt": "blurry"}, {"negative_header": False},
                 {"guidance_scale": 1.5}):
        assert not torch.equal(default, pipe(PROMPTS, temperature=0.0, output_type="latent", **call).tokens), call


def test_the_layout_is_the_documented_prefix_function_at_every_index(pipe):
    height, width = 3, 5
    layout = emu3_layout(pipe.special, height, width, pipe.lm.vocab_size)
    allowed = documented_prefix_fn(pipe, height, width)
    wrapper = pipe.processor.tokenizer.convert_tokens_to_ids(pipe.processor.tokenizer.image_wrapper_token)
    for t in range(layout_length(height, width) + 2):
        ids = torch.tensor([7, wrapper, *([0] * t)])  # the prompt's end, then t generated tokens
        logits = layout.constrain(torch.zeros(1, 1, pipe.lm.vocab_size), torch.tensor([[t]]))[0, 0]
        assert set(torch.nonzero(logits == 0).flatten().tolist()) == set(allowed(0, ids)), t


def test_sampled_images_keep_the_layout_and_jacobi_drafts_image_tokens(pipe):
    out = pipe(PROMPTS, method="sjd", budget="fixed", output_type="latent", generator=torch.Generator().manual_seed(0))
    special = pipe.special
    rows = out.tokens[:, :-3].view(3, 4, 5)
    assert (rows[..., 4] == special.eol).all() and set(rows[..., :4].flatten().tolist()) <= set(special.visual)
    assert out.tokens[:, -3:].tolist() == [[special.eof, special.eoi, special.eos]] * 3
    from image_ar.llamagen.methods import MethodContext, llamagen_jacobi_drafter
    from mmspec.loop import DecodeState
    from mmspec.sampling import SamplingParams

    drafter = llamagen_jacobi_drafter(MethodContext(pipe, SamplingParams(1.0), 3.0, None, 2), window=8)
    state = DecodeState.new(2, 23, "cpu")
    drafter.begin(None, state)
    assert set(drafter.propose(state).tokens.flatten().tolist()) <= set(special.visual)  # SJD's image-token init


def test_a_saved_folder_loads_and_gives_the_same_images(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "emu3")
    loaded = Emu3Pipeline.from_pretrained(tmp_path / "emu3")
    loaded.set_progress_bar_config(disable=True)
    kwargs = dict(method="sjd", budget="fixed", output_type="latent")
    first = pipe(PROMPTS[:2], generator=torch.Generator().manual_seed(3), **kwargs).tokens
    assert torch.equal(loaded(PROMPTS[:2], generator=torch.Generator().manual_seed(3), **kwargs).tokens, first)
    assert main(["generate", "--family", "emu3", "--model", str(tmp_path / "emu3"), "--out", str(tmp_path / "out"),
                 "--quiet", "--prompt", "a red circle", "--num-images", "1", "--method", "gsd"]) == 0
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["num_images"] == 1
    with pytest.raises(InputError, match="is a emu3 model; load it with the emu3 pipeline"):
        from image_ar.transformers_ar.pipeline import JanusPipeline

        JanusPipeline.from_pretrained(tmp_path / "emu3")


@pytest.mark.parametrize("call, match", [
    (dict(prompt="x", method="gsd", method_kwargs={"embeddings": "codebook"}), "Emu3's mixes text and image"),
    (dict(prompt="x", negative_prompt=["a", "b"]), "give one or one per prompt"),
    (dict(input_ids=torch.tensor([[1, 2]]), attention_mask=torch.tensor([[1, 1]])), "need height and width"),
    (dict(prompt="x", num_inference_steps=20), r"autoregressive: .* fixed by the image size \(ratio and image_area"),
])
def test_bad_calls_are_one_line_errors(pipe, call, match):
    with pytest.raises(InputError, match=match):
        pipe(**call)


@pytest.mark.parametrize("family", ["janus", "emu3"])
def test_bench_family_on_a_model_folder(family, tmp_path):
    """`mmspec bench --family janus|emu3 --family-option model=FOLDER`: vanilla and the Jacobi methods side by side
    on a prompts file, lossless ones exact at temperature 0, token calibration (scored under the model's CFG and, for
    Emu3, its layout) at temperature 1; without a model folder, a one-line error."""
    from image_ar.transformers_ar.tiny import main as write_tiny

    assert write_tiny([str(tmp_path / "model"), "--model", family]) == 0
    (tmp_path / "prompts.txt").write_text("a red circle\n\ntwo blue squares on green\n")
    for temperature in ("0", "1"):
        out = tmp_path / f"bench-{temperature}"
        assert main(["bench", "--family", family, "--family-option", f"model={tmp_path / 'model'}",
                     "--family-option", f"prompts={tmp_path / 'prompts.txt'}", "--methods", "vanilla,sjd",
                     "--batch-sizes", "2", "--num-samples", "2", "--repeats", "1", "--warmup", "0",
                     "--temperature", temperature, "--threads", "1", "--no-plots", "--quiet", "--out", str(out)]) == 0
        text = (out / "summary.md").read_text()
        if temperature == "0":
            assert "exactness=1.000" in text.split("| sjd |")[1]
        else:
            assert "pit_ks" in json.dumps(json.loads((out / "summary.json").read_text()))
    assert main(["bench", "--family", family, "--out", str(tmp_path / "none"), "--quiet"]) == 2


def test_target_probs_score_the_generated_tokens_as_the_loop_drew_them(pipe):
    """The teacher-forced distributions (calibration's reference) are the loop's: at temperature 0 each is the
    one-hot of the greedy token (layout included), at temperature 1 with CFG they match the law at the first token."""
    greedy = pipe(PROMPTS, temperature=0.0, output_type="latent").tokens
    probs = pipe.target_probs(PROMPTS, greedy, temperature=0.0)  # [3, 23, V]
    assert torch.equal(probs.argmax(-1), greedy) and torch.all(probs.max(-1).values == 1)
    first = pipe(PROMPTS, temperature=1.0, guidance_scale=3.0, output_type="latent",
                 generator=torch.Generator().manual_seed(0)).tokens
    probs = pipe.target_probs(PROMPTS, first, guidance_scale=3.0)
    assert torch.all(probs.gather(-1, first.unsqueeze(-1)) > 0)  # every drawn token is in its law's support


def test_lantern_borrows_only_among_visual_tokens(pipe):
    """LANTERN on Emu3: a visual token's neighbours are the visual tokens of its code's nearest codes, a text token
    has none (itself); at delta 0 it is greedy vanilla exactly, sampled it keeps the layout."""
    table = pipe.lantern_table(5)  # [V, 5]
    special, bpe = pipe.special, pipe.model.model.vocabulary_mapping.img2bpe_mapping_tensor.long()
    book = pipe.model.model.vqmodel.quantize.embedding.weight.detach()
    nearest = torch.cdist(book, book).topk(6, largest=False).indices[:, 1:]  # [C, 5] codes, itself excluded
    assert set(table[bpe[3]].tolist()) == set(bpe[nearest[3]].tolist())
    assert table[special.eol].tolist() == [special.eol] * 5
    greedy = pipe(PROMPTS, temperature=0.0, output_type="latent").tokens
    exact = pipe(PROMPTS, temperature=0.0, method="sjd", method_kwargs={"accept": "lantern", "delta": 0.0},
                 budget="fixed", output_type="latent").tokens
    assert torch.equal(exact, greedy)
    out = pipe(PROMPTS, method="sjd", method_kwargs={"accept": "lantern", "delta": 0.2}, budget="fixed",
               output_type="latent", generator=torch.Generator().manual_seed(1)).tokens
    rows = out[:, :-3].view(3, 4, 5)
    assert (rows[..., 4] == special.eol).all() and set(rows[..., :4].flatten().tolist()) <= set(special.visual)
