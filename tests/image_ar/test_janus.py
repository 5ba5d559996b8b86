"""transformers' Janus as a discrete image target (issue 26): a tiny random JanusForConditionalGeneration with its own
processor built offline (`image_ar.transformers_ar.tiny`). Greedy vanilla through mmspec == transformers' own
`generate(generation_mode="image", do_sample=False)` on a ragged batch with CFG (same codes, same decoded images);
sampled sjd follows the model's own CFG law (with a negative control); the folder round trip, the CLI and the one-line
refusals."""

from __future__ import annotations

import json

import pytest
import torch

from image_ar.transformers_ar.pipeline import JanusPipeline
from image_ar.transformers_ar.prompts import right_pad
from image_ar.transformers_ar.tiny import tiny_janus_pipeline
from mmspec.cli import main
from mmspec.errors import InputError
from mmspec.testing.pipeline_tester import PromptPipelineTesterMixin

PROMPTS = ["a red circle", "two small blue squares on a green background", "a cross"]  # ragged once tokenized


@pytest.fixture(scope="module")
def pipe() -> JanusPipeline:
    pipe = tiny_janus_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


class TestJanusPipeline(PromptPipelineTesterMixin):
    pipeline_class = JanusPipeline
    image_shape, token_shape, prompts = (16, 16), (16,), tuple(PROMPTS)
    steps_instead = r"fixed by the image size \(the model's vision_config.num_image_tokens"

    def get_dummy_components(self) -> dict:
        pipe = tiny_janus_pipeline()
        return {"model": pipe.model, "processor": pipe.processor}


def transformers_codes(pipe: JanusPipeline, prompts: list[str], guidance_scale: float) -> torch.Tensor:
    """transformers' own image generation, prompts built as its docs do (chat template, left padding)."""
    proc = pipe.processor
    texts = [proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": p}]}],
                                      add_generation_prompt=True) for p in prompts]
    enc = proc(text=texts, generation_mode="image", padding=True, return_tensors="pt")
    assert (enc["attention_mask"] == 0).any()  # the batch is ragged: left padding is exercised
    return pipe.model.generate(**enc, generation_mode="image", do_sample=False, guidance_scale=guidance_scale)


def test_greedy_vanilla_equals_transformers_image_generation_with_cfg(pipe):
    reference = transformers_codes(pipe, PROMPTS, 5.0)  # [3, 16]
    out = pipe(PROMPTS, temperature=0.0, guidance_scale=5.0, output_type="pt")
    assert torch.equal(out.tokens, reference)
    assert len(set(reference.flatten().tolist())) > 8  # varied codes: the comparison can fail
    images = ((pipe.model.decode_image_tokens(reference).permute(0, 3, 1, 2) + 1) / 2).clamp(0, 1)
    torch.testing.assert_close(out.images, images, atol=1e-5, rtol=0)
    other = pipe(PROMPTS, temperature=0.0, guidance_scale=2.0, output_type="latent").tokens
    assert not torch.equal(other, reference)  # the CFG scale matters, so it is the one transformers used


def test_an_interrupted_call_decodes_the_codes_made_with_the_rest_a_zero_latent(pipe):
    def stop_after_five(p, step, num_tokens, kwargs):
        p._interrupt = num_tokens >= 5

    out = pipe(PROMPTS[:2], callback_on_step_end=stop_after_five, output_type="pt",
               generator=torch.Generator().manual_seed(0))
    made = out.tokens >= 0  # [2, 16]
    assert pipe.interrupt and not made.all() and made[:, :5].all() and not made[:, -1].any()
    vq = pipe.model.model.vqmodel  # its own lookup and decoder, the cells not made zero
    entry = vq.quantize.get_codebook_entry(out.tokens.clamp_min(0)) * made.view(2, 1, 4, 4)  # [2, C, 4, 4]
    expected = ((vq.decoder(vq.post_quant_conv(entry)) + 1) / 2).clamp(0, 1)
    torch.testing.assert_close(out.images, expected)
    full = pipe(PROMPTS[:2], output_type="pt", temperature=0.0)  # the lookup is itself again afterwards
    torch.testing.assert_close(full.images, pipe.decode(full.tokens))


def test_input_ids_of_either_padding_side_give_the_prompt_call(pipe):
    texts = [pipe.processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": p}]}],
                                                add_generation_prompt=True) for p in PROMPTS]
    enc = pipe.processor(text=texts, generation_mode="image", padding=True, return_tensors="pt")
    by_ids = pipe(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], temperature=0.0,
                  output_type="latent").tokens
    assert torch.equal(by_ids, pipe(PROMPTS, temperature=0.0, output_type="latent").tokens)
    ids, mask = right_pad(enc["input_ids"], enc["attention_mask"])
    assert (mask[:, 0] == 1).all() and torch.equal(ids[mask.bool()], enc["input_ids"][enc["attention_mask"].bool()])


def test_method_tables_come_from_the_models_own_codebook_and_embeddings(pipe):
    from image_ar.llamagen.methods import MethodContext, acceptance_rule
    from mmspec.sampling import SamplingParams

    assert pipe.image_token_layout() == (16, 4, 64)
    ctx = MethodContext(pipe, SamplingParams(1.0), 5.0, None, 1)
    gsd = acceptance_rule(ctx, "gsd")
    codes = torch.arange(64)
    expected = pipe.model.model.generation_aligner(pipe.model.model.generation_embeddings(codes))
    torch.testing.assert_close(gsd.embeddings, expected.detach().float())
    lantern = acceptance_rule(ctx, "lantern", k=5)
    book = pipe.model.model.vqmodel.quantize.embedding.weight.detach()
    nearest = torch.cdist(book, book).topk(6, largest=False).indices[:, 1:]  # itself excluded
    assert lantern.neighbours.shape[0] == 64 and set(lantern.neighbours[3, :5].tolist()) == set(nearest[3].tolist())


@pytest.mark.parametrize("method, kwargs", [("sjd", {"window": 4}), ("eagle", {"depth": 2, "top_k": 4,
                                                                                "total_tokens": 8})])
def test_sampled_methods_follow_the_models_own_cfg_law_with_a_negative_control(method, kwargs):
    """600 images of one prompt at temperature 1 with SJD (window 4) or EAGLE trees (an untrained drafter: its
    drafts are still verified losslessly), fixed budgets: the first two codes, grouped by the first, fit the
    CFG-combined softmax of the model's own forward (text model + generation head run by transformers over the
    prompt and the first code, no mmspec cache); the same counts against the law at temperature 0.8 must fail."""
    from image_ar.transformers_ar.eagle import ImageAREagleDrafter
    from mmspec.testing.distributions import assert_fits_law_not_control

    pipe = tiny_janus_pipeline(seed=1)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(0)
    pipe.eagle_drafter = ImageAREagleDrafter.for_target(pipe.lm)
    n, scale = 600, 3.0
    out = pipe(PROMPTS[0], num_images_per_prompt=n, guidance_scale=scale, method=method,
               method_kwargs=kwargs, budget="fixed", output_type="latent",
               generator=torch.Generator().manual_seed(0))
    assert out.stats.num_accepted_tokens > 0
    pairs = out.tokens[:, :2].tolist()
    prompt = pipe.encode_prompt(PROMPTS[0])
    ids = prompt.input_ids[:, : int(prompt.lengths[0])]
    uncond = ids.masked_fill((ids != pipe.special.bos) & (ids != pipe.special.boi), pipe.special.pad)

    def law(temperature: float):
        def next_probs(first: int):
            rows = []
            with torch.no_grad():
                for row in (ids, uncond):
                    x = torch.cat([pipe.model.get_input_embeddings()(row),
                                   pipe.model.prepare_embeddings_for_image_generation(torch.tensor([[first]]))], 1)
                    h = pipe.model.model.language_model(inputs_embeds=x).last_hidden_state[:, -1]
                    rows.append(pipe.model.model.generation_head(h)[0].double())
            logits = rows[1] + scale * (rows[0] - rows[1])
            return torch.softmax(logits / temperature, -1).numpy()
        return next_probs

    assert_fits_law_not_control(pairs, law, 0.8, min_dof=3)


def test_a_saved_folder_loads_in_transformers_layout_and_gives_the_same_images(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "janus")
    assert (tmp_path / "janus" / "config.json").is_file() and not (tmp_path / "janus" / "model_index.json").exists()
    loaded = JanusPipeline.from_pretrained(tmp_path / "janus")
    loaded.set_progress_bar_config(disable=True)
    kwargs = dict(method="sjd", budget="fixed", output_type="latent", generator=torch.Generator().manual_seed(3))
    first = pipe(PROMPTS[:2], **kwargs).tokens
    kwargs["generator"] = torch.Generator().manual_seed(3)
    assert torch.equal(loaded(PROMPTS[:2], **kwargs).tokens, first)


def test_mmspec_generate_runs_a_janus_folder(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "janus")
    assert main(["generate", "--family", "janus", "--model", str(tmp_path / "janus"), "--out", str(tmp_path / "out"),
                 "--quiet", "--prompt", "a red circle", "--num-images", "2", "--method", "sjd"]) == 0
    assert sorted(p.name for p in (tmp_path / "out" / "images").iterdir()) == ["a-red-circle_000.png",
                                                                                "a-red-circle_001.png"]
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["family"] == "janus" and stats["num_images"] == 2


@pytest.mark.parametrize("call, match", [
    (dict(prompt="x", method="eagle"), "needs an EAGLE drafter trained for this model: run `mmspec train "
                                       "image-ar-drafter"),
    (dict(prompt="x", method="medusa"), "runs the methods vanilla, sjd, gsd, eagle, lantern"),
    (dict(prompt="x", method="sjd", method_kwargs={"depth": 3}), "takes"),
    (dict(prompt="x", num_inference_steps=20), r"autoregressive: .* fixed by the image size \(the model's "
                                               "vision_config.num_image_tokens"),
])
def test_bad_calls_are_one_line_errors(pipe, call, match):
    with pytest.raises(InputError, match=match):
        pipe(**call)


def test_other_transformers_image_models_are_refused_before_loading(tmp_path, capsys):
    folder = tmp_path / "chameleon"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "chameleon",
                                                    "architectures": ["ChameleonForConditionalGeneration"]}))
    (folder / "preprocessor_config.json").write_text("{}")
    with pytest.raises(InputError, match="ChameleonForConditionalGeneration.*image-token logit to the minimum"):
        JanusPipeline.from_pretrained(folder)
    assert main(["generate", "--family", "janus", "--out", str(tmp_path / "o"), "--prompt", "a red circle"]) == 2
    assert "no embedded default: pass --model" in capsys.readouterr().err and not (tmp_path / "o").exists()
