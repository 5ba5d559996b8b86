"""Text-to-image LlamaGen from strings (issue 25): the caption cleaning, the official padding recipe computed
independently, `pipe("...")` equal to the same call with those prompt_embeds, negative prompts, save / load with the
text encoder, and one-line errors. (Greedy speculative == greedy vanilla on ragged caption batches with CFG: the
method contract, tests/test_contract.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from llamagen_dummies import get_dummy_components, get_dummy_t2i_components

from image_ar.llamagen.pipeline import LlamaGenPipeline
from image_ar.llamagen.text import clean_caption, left_pad_captions, preprocess_caption
from mmspec.errors import InputError
from mmspec.testing import seeded_generators
from mmspec.testing.pipeline_tester import PromptPipelineTesterMixin

CAPTIONS = ["a red circle", "the small blue square on a green background", "green cross"]  # ragged: 4, 9, 3 tokens


@pytest.fixture(scope="module")
def pipe():
    pipe = LlamaGenPipeline(**get_dummy_t2i_components())
    pipe.set_progress_bar_config(disable=True)
    return pipe


class TestLlamaGenT2IPipeline(PromptPipelineTesterMixin):
    pipeline_class = LlamaGenPipeline
    image_shape, token_shape, prompts = (16, 16), (16,), tuple(CAPTIONS)
    steps_instead = "one token per image position, so its 16 steps are fixed by the image size"

    def get_dummy_components(self) -> dict:
        return get_dummy_t2i_components()

    def get_dummy_inputs(self) -> dict:
        return {"guidance_scale": 3.0}


def official_prompt_embeds(pipe, captions):
    """The official recipe written out independently: T5Embedder.get_text_embeddings (clean twice, pad to max
    length, EOS), then sample_t2i.py's left padding (flip the mask, rotate each row by its valid count) and
    `emb * mask`."""
    texts = [clean_caption(clean_caption(c)) for c in captions]
    tokens = pipe.tokenizer(texts, max_length=8, padding="max_length", truncation=True, return_attention_mask=True,
                            add_special_tokens=True, return_tensors="pt")
    with torch.no_grad():  # as the official embedder (torch picks another SDPA kernel with autograd on)
        embs = pipe.text_encoder(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])[
            "last_hidden_state"]
    masks = tokens["attention_mask"]
    rows = []
    for emb, mask in zip(embs, masks):
        valid = int(mask.sum())
        rows.append(torch.cat([emb[valid:], emb[:valid]]))
    new_masks = torch.flip(masks, dims=[-1])
    return torch.stack(rows) * new_masks[:, :, None], new_masks


def test_caption_cleaning_is_the_official_one():
    """Same as diffusers' copy of the cleaning wherever the copies agree, and LlamaGen's where they differ (its
    basic_clean strips in the middle: a caption left starting with a quote after a url is unquoted)."""
    from diffusers import PixArtAlphaPipeline

    class Holder:
        bad_punct_regex = PixArtAlphaPipeline.bad_punct_regex

    captions = ["A Photo of a <person> at http://x.com/a.png!!", "Cute—cat “quoted” ‘x’ &amp; &quot;dogs&quot;",
                "this-is-my-cute-cat_now", "IP 192.168.0.1 #123 #123456 1234567 file.jpg",
                "jc6640 jc6640vc 6640vc231 free shipping", "click on here page 12 3x4 a : b,c.d", "'Quoted caption'",
                "<b>bold</b> @nick 中文 text", "A small red circle on a blue background", "...dots... *** stars ***"]
    for caption in captions:
        assert clean_caption(caption) == PixArtAlphaPipeline._clean_caption(Holder(), caption), caption
    assert clean_caption('http://a.com "cat"') == "cat"
    assert preprocess_caption("  A RED Circle ", clean=False) == "a red circle"


def test_left_padding_matches_the_official_loop():
    features, mask = torch.randn(3, 6, 4), torch.tensor([[1, 1, 0, 0, 0, 0], [1] * 6, [1, 0, 0, 0, 0, 0]])
    padded, new_mask = left_pad_captions(features, mask)
    for row in range(3):
        valid = int(mask[row].sum())
        expected = torch.cat([features[row, valid:], features[row, :valid]]) * mask[row].flip(0)[:, None]
        assert torch.equal(padded[row], expected)
    assert torch.equal(new_mask, mask.flip(-1).bool())


def test_prompt_strings_equal_the_official_prompt_embeds(pipe):
    embeds, mask = official_prompt_embeds(pipe, CAPTIONS)
    ours, our_mask = pipe.encode_prompt(CAPTIONS)
    torch.testing.assert_close(ours, embeds, atol=0, rtol=0)
    assert torch.equal(our_mask, mask.bool())
    call = {"guidance_scale": 3.0, "temperature": 1.0, "num_images_per_prompt": 2, "output_type": "latent"}
    by_string = pipe(CAPTIONS, generator=seeded_generators(6, 1), **call).tokens
    by_embeds = pipe(prompt_embeds=embeds, prompt_embeds_mask=mask, generator=seeded_generators(6, 1), **call).tokens
    assert torch.equal(by_string, by_embeds) and by_string.shape == (6, 16)
    assert torch.equal(pipe(prompt=CAPTIONS, generator=seeded_generators(6, 1), **call).tokens, by_string)


def test_negative_prompt_replaces_the_null_caption(pipe):
    call = {"guidance_scale": 4.0, "temperature": 0.0, "output_type": "latent"}
    plain = pipe(CAPTIONS[:2], **call).tokens
    negative = pipe(CAPTIONS[:2], negative_prompt="blue cross", **call).tokens
    neg_embeds, neg_mask = pipe.encode_prompt("blue cross")
    by_embeds = pipe(CAPTIONS[:2], negative_prompt_embeds=neg_embeds, negative_prompt_embeds_mask=neg_mask,
                     **call).tokens
    assert torch.equal(negative, by_embeds) and not torch.equal(negative, plain)
    assert torch.equal(pipe(CAPTIONS[:2], negative_prompt="blue cross", method="sjd", **call).tokens, negative)


def test_save_and_load_keep_the_text_encoder_and_the_caption_cleaning(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)  # (the same images after loading: TestLlamaGenT2IPipeline)
    loaded = LlamaGenPipeline.from_pretrained(tmp_path)
    assert loaded.text_encoder is not None and loaded.config.clean_caption is True


def test_bad_text_inputs_are_one_line_errors(pipe):
    components = get_dummy_t2i_components()
    bare = LlamaGenPipeline(**{k: v for k, v in components.items() if k not in ("text_encoder", "tokenizer")})
    with pytest.raises(InputError, match="no text_encoder: pass prompt_embeds"):
        bare("a red circle")
    with pytest.raises(InputError, match="class-conditional"):
        LlamaGenPipeline(**get_dummy_components())("a red circle")
    with pytest.raises(InputError, match="not both"):
        pipe("a red circle", prompt_embeds=torch.zeros(1, 8, 16))
    with pytest.raises(InputError, match="non-empty list of strings"):
        pipe(prompt=["a red circle", 3])
    with pytest.raises(InputError, match="needs CFG"):
        pipe("a red circle", negative_prompt="blue", guidance_scale=1.0)
    with pytest.raises(InputError, match="one row or one per caption"):
        pipe(CAPTIONS, negative_prompt=["blue", "red"])
    with pytest.raises(InputError, match="num_inference_steps .* steps are fixed by the image size"):
        pipe("a red circle", num_inference_steps=50)
    with pytest.raises(InputError, match="caption_dim"):
        from transformers import T5Config, T5EncoderModel

        LlamaGenPipeline(**{**components, "text_encoder": T5EncoderModel(T5Config(d_model=24, num_layers=1))})
    with pytest.raises(InputError, match="pass both or neither"):
        LlamaGenPipeline(**{**components, "tokenizer": None})


def test_convert_writes_a_pipeline_that_takes_prompts(pipe, tmp_path):
    """`mmspec convert llamagen --t5 FOLDER`: official t2i GPT / VQ files plus a local T5 folder -> a folder whose
    pipeline turns strings into the same images; a c2i GPT with --t5, or a folder without a T5, is refused."""

    from mmspec.cli import main

    gpt_file, vq_file, t5 = tmp_path / "t2i_X_64.pt", tmp_path / "vq_ds4_t2i.pt", tmp_path / "flan-t5"
    torch.save({"model": pipe.transformer.state_dict()}, gpt_file)  # the official container and key layout
    torch.save({"model": pipe.vqvae.state_dict()}, vq_file)
    pipe.text_encoder.save_pretrained(t5)
    pipe.tokenizer.save_pretrained(t5)
    args = ["convert", "llamagen", "--gpt", str(gpt_file), "--vq", str(vq_file), "--gpt-config",
            json.dumps({"n_head": 2, "multiple_of": 16}), "--vq-config", json.dumps({"norm_num_groups": 8}),
            "--block-size", "16"]
    assert main([*args, "--t5", str(t5), "--out", str(tmp_path / "out")]) == 0
    converted = LlamaGenPipeline.from_pretrained(tmp_path / "out")
    converted.set_progress_bar_config(disable=True)
    assert converted.default_guidance_scale() == 7.5  # the official t2i sampling script's cfg-scale
    call = {"temperature": 0.0, "output_type": "latent", "guidance_scale": 4.0}
    assert torch.equal(converted(CAPTIONS, **call).tokens, pipe(CAPTIONS, **call).tokens)
    assert main([*args, "--t5", str(tmp_path), "--out", str(tmp_path / "bad")]) == 2  # no config.json there
    assert not (tmp_path / "bad").exists()


def test_saved_tokenizer_entry_loads_on_every_transformers(pipe, tmp_path):
    """transformers 5 names its fast tokenizer class TokenizersBackend, which 4.x lacks: the folder names the
    class both read."""

    pipe.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["tokenizer"] == ["transformers",
                                                                                    "PreTrainedTokenizerFast"]


def test_world_t5_tokenizer_fits_every_world_caption():
    from image_ar.llamagen.train_t2i import CAPTION_TOKENS, world_t5_tokenizer
    from mmspec.data import generate_batch

    tokenizer = world_t5_tokenizer()
    captions = generate_batch(500, 0, split="train", image_size=32).captions
    tokens = tokenizer(captions)["input_ids"]
    assert all(t[-1] == tokenizer.eos_token_id and tokenizer.bos_token_id not in t for t in tokens)
    assert max(len(t) for t in tokens) <= CAPTION_TOKENS


def test_attribute_agreement_reads_real_scenes_and_catches_wrong_ones():
    from mmspec.data import generate_batch
    from mmspec.metrics import attribute_agreement

    batch = generate_batch(64, 3, split="val", image_size=32)
    own = attribute_agreement(batch.float_images(), batch)
    shuffled = attribute_agreement(batch.float_images().flip(0), batch)
    assert own["all_attributes"] >= 0.9 and min(own["attributes"].values()) >= 0.9
    assert shuffled["all_attributes"] < 0.2 and set(own["attributes"]) == {"shape", "colour", "size", "position",
                                                                           "background"}


def test_train_t2i_makes_a_pipeline_folder_with_a_card(tmp_path):
    from mmspec.cli import main

    out = tmp_path / "out"
    assert main(["train", "llamagen-t2i", "--out", str(out), "--work-dir", str(tmp_path / "work"),
                 "--num-train-images", "64", "--target-steps", "2", "--draft-steps", "2", "--batch-size", "8",
                 "--eval-captions", "4", "--tune-captions", "2", "--guidance-grid", "1,4", "--no-compile",
                 "--threads", "1", "--quiet"]) == 0
    card = (out / "README.md").read_text()
    assert "pipeline_tag: text-to-image" in card and "every attribute agrees" in card
    sweep = json.loads((out / "training.json").read_text())["eval"]["guidance"]["sweep"]
    assert [e["guidance_scale"] for e in sweep] == [1, 4] and "--guidance-grid 1,4" in card  # the scales tried
    # its EAGLE drafter, trained on world images and their captions through the pipeline's text encoder
    assert main(["train", "llamagen-drafter", "--pipeline", str(out), "--work-dir", str(tmp_path / "drafter-work"),
                 "--num-train-sequences", "64", "--steps", "2", "--batch-size", "8", "--eval-images", "2",
                 "--no-compile", "--threads", "1", "--quiet"]) == 0
    assert "with their captions" in (out / "eagle_drafter" / "README.md").read_text()
    loaded = LlamaGenPipeline.from_pretrained(out)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.eagle_drafter is not None
    caption = "a small red circle on a blue background"
    assert loaded(caption, output_type="pt").images.shape == (1, 3, 32, 32)
    greedy = {"temperature": 0.0, "output_type": "latent"}
    assert torch.equal(loaded(caption, method="eagle", **greedy).tokens, loaded(caption, **greedy).tokens)


def test_train_t2i_at_64_pixels_and_its_world_drafter_data(tmp_path):
    """`--image-size 64`: captions with 64x64 world images through the same tokenizer, a GPT of 16x16 = 256 tokens,
    judged at that size, the card saying so; the EAGLE trainer's world data follows the pipeline's image size and its
    eval is judged by the world judge."""
    from image_ar.llamagen.train_eagle import is_world_pipeline, world_sequences
    from mmspec.cli import main

    out = tmp_path / "out"
    assert main(["train", "llamagen-t2i", "--out", str(out), "--work-dir", str(tmp_path / "work"),
                 "--image-size", "64", "--stages", "target,eval", "--num-train-images", "16", "--target-steps", "2",
                 "--batch-size", "4", "--eval-captions", "2", "--tune-captions", "2", "--guidance-grid", "1",
                 "--no-compile", "--threads", "1", "--quiet"]) == 0
    card = (out / "README.md").read_text()
    assert "(64x64 images, 256 tokens)" in card and "--image-size 64" in card
    pipe = LlamaGenPipeline.from_pretrained(out)
    assert pipe.transformer.config.block_size == 256
    data = world_sequences(pipe, 4, 0)
    assert data["ids"].shape == (4, 256) and data["text_ids"].shape[0] == 4
    assert is_world_pipeline(pipe)


def test_bench_family_on_held_out_captions(pipe, tmp_path):
    """`mmspec bench --family llamagen-t2i`: every method on held-out world captions, the judge's attribute
    agreement and caption-matched world-FID as quality, lossless methods exact at temperature 0, and the token
    calibration (scored on the captions) at temperature 1."""

    from mmspec.cli import main

    pipe.save_pretrained(tmp_path / "model")
    for temperature in ("0", "1"):
        out = tmp_path / f"bench-{temperature}"
        assert main(["bench", "--family", "llamagen-t2i", "--family-option", f"model={tmp_path / 'model'}",
                     "--methods", "vanilla,sjd", "--batch-sizes", "2", "--num-samples", "2", "--repeats", "1",
                     "--warmup", "0", "--temperature", temperature, "--threads", "1", "--no-plots", "--quiet",
                     "--out", str(out)]) == 0
        text = (out / "summary.md").read_text()
        assert "attribute_agreement=" in text and "world_fid=" in text
        if temperature == "0":
            assert "exactness=1.000" in text.split("| sjd |")[1]
        else:
            assert "pit_ks" in json.dumps(json.loads((out / "summary.json").read_text()))
