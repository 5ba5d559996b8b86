"""Qwen2-VL / Qwen2.5-VL targets (`vlm.qwen2_vl`): tiny random models built from configs; M-RoPE prompts with
images of different sizes in one ragged batch; greedy vanilla and greedy tree drafting == transformers' own
`generate(do_sample=False)` token for token; tree verification logits == the forward of each root-to-node path."""

from __future__ import annotations

import pytest
import torch

from mmspec.lm import LMTarget
from mmspec.sampling import SamplingParams
from vlm.family import drafter_model
from vlm.target import VLMInputs, cached_vlm, prefill_vlm

VISION_START, VISION_END, IMAGE_PAD = 151652, 151653, 151655
PATCH_DIM = 3 * 2 * 14 * 14  # channels * temporal patch * patch * patch


def tiny_qwen_vl(kind: str = "qwen2_vl", seed: int = 0, **text_overrides):
    import transformers as tf

    torch.manual_seed(seed)
    text = dict(vocab_size=151700, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 1], rope_theta=1e4), **text_overrides)
    vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    if kind == "qwen2_vl":
        config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_PAD,
                                  vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
        return tf.Qwen2VLForConditionalGeneration(config).eval()
    vision.update(intermediate_size=64, out_hidden_size=32, fullatt_block_indexes=[1], window_size=56)
    config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_PAD,
                                 vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    return tf.Qwen2_5_VLForConditionalGeneration(config).eval()


def row_with_image(before: list[int], grid: tuple[int, int], after: list[int]) -> list[int]:
    """Token ids as the processor writes them: text, <|vision_start|>, one <|image_pad|> per merged patch,
    <|vision_end|>, text (grid = (h, w) patches of 14 pixels, t = 1)."""
    return before + [VISION_START] + [IMAGE_PAD] * (grid[0] * grid[1] // 4) + [VISION_END] + after


# ragged rows, images of three sizes (grids 4x6, 4x4, 6x4 patches), one text-only row in the second batch
GRIDS = [(4, 6), (4, 4), (6, 4)]
ROWS = [row_with_image([10, 11, 12], GRIDS[0], [13]), row_with_image([20], GRIDS[1], [21, 22, 23, 24]),
        row_with_image([30, 31], GRIDS[2], [32, 33])]


def qwen_inputs(rows: list[list[int]], grids: list[tuple[int, int] | None], seed: int = 0) -> VLMInputs:
    """Right-padded VLMInputs with random patches for each row's image (None = a text-only row)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    used = [g for g in grids if g is not None]
    if not used:
        return VLMInputs(ids, mask)
    pixels = torch.randn(sum(h * w for h, w in used), PATCH_DIM, generator=gen)
    grid_thw = torch.tensor([[1, h, w] for h, w in used])
    types = (ids == IMAGE_PAD).int()
    return VLMInputs(ids, mask, pixels, extras={"image_grid_thw": grid_thw, "mm_token_type_ids": types})


def transformers_greedy(model, inputs: VLMInputs, steps: int) -> list[list[int]]:
    """transformers' own `generate(do_sample=False)` for each row alone (no padding, no EOS stop)."""
    out, offset = [], 0
    grids = inputs.extras.get("image_grid_thw")
    image = 0
    for i in range(inputs.input_ids.shape[0]):
        n = int(inputs.attention_mask[i].sum())
        ids = inputs.input_ids[i: i + 1, :n]
        kwargs = {}
        if bool((ids == IMAGE_PAD).any()):
            g = grids[image: image + 1]
            count = int(g.prod())
            kwargs = dict(pixel_values=inputs.pixel_values[offset: offset + count], image_grid_thw=g,
                          mm_token_type_ids=(ids == IMAGE_PAD).int())
            offset, image = offset + count, image + 1
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, pad_token_id=0, **kwargs)
        out.append(gen[0, n:].tolist())
    return out


def greedy_runs(lm, drafter, inputs: VLMInputs, steps: int):
    from mmspec.lm import NoDrafter
    from mmspec.loop import generate

    params, b = SamplingParams(temperature=0.0), inputs.input_ids.shape[0]
    vanilla = generate(LMTarget(lm, params, steps, prefill_fn=prefill_vlm), NoDrafter(), "greedy", inputs,
                       batch_size=b, max_new_tokens=steps)
    tree = drafter.loop_drafter(drafter, lm, params, top_k=3, depth=3, total_tokens=8)
    spec = generate(LMTarget(lm, params, steps, max_draft_nodes=8, prefill_fn=prefill_vlm), tree, "lossless", inputs,
                    batch_size=b, max_new_tokens=steps)
    return vanilla, spec


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("drafter_kind", ["eagle", "msd", "vispec", "eagle3"])
def test_greedy_vanilla_and_tree_equal_transformers_generate_on_images_of_three_sizes(kind, drafter_kind):
    model = tiny_qwen_vl(kind)
    inputs = qwen_inputs(ROWS, GRIDS)
    steps = 10
    reference = transformers_greedy(model, inputs, steps)
    lm = cached_vlm(model)
    torch.manual_seed(1)
    drafter = drafter_model(drafter_kind).for_target(lm).eval()
    vanilla, spec = greedy_runs(lm, drafter, inputs, steps)
    assert [t.tolist() for t in vanilla.tokens] == reference
    assert [t.tolist() for t in spec.tokens] == reference


def test_a_sliding_window_stays_exact_past_it_with_m_rope():
    """use_sliding_window with a 12-token window on the second layer (max_window_layers=1) under 11-12-token prompts
    and 16 new tokens: the window runs by sequence index while the rotary positions are M-RoPE's; greedy vanilla and
    EAGLE trees == transformers' generate, full attention differs."""
    model = tiny_qwen_vl(use_sliding_window=True, sliding_window=12, max_window_layers=1)
    inputs = qwen_inputs(ROWS, GRIDS)
    reference = transformers_greedy(model, inputs, 16)
    lm = cached_vlm(model)
    assert lm.window == 12
    torch.manual_seed(1)
    drafter = drafter_model("eagle").for_target(lm).eval()
    vanilla, spec = greedy_runs(lm, drafter, inputs, 16)
    assert [t.tolist() for t in vanilla.tokens] == reference == [t.tolist() for t in spec.tokens]
    lm.window = None
    assert [t.tolist() for t in greedy_runs(lm, drafter, inputs, 16)[0].tokens] != reference


def test_text_only_rows_mixed_with_image_rows_and_a_later_text_only_call():
    """A text-only row sits at t = h = w = index (delta 0) next to image rows; a later text-only batch does not
    reuse an earlier call's deltas (transformers' own `rope_deltas` state would)."""
    model = tiny_qwen_vl(seed=3)
    rows = [ROWS[0], [40, 41, 42, 43, 44], ROWS[2]]
    grids = [GRIDS[0], None, GRIDS[2]]
    lm = cached_vlm(model)
    for kind in ("eagle", "vispec"):
        drafter = drafter_model(kind).for_target(lm).eval()
        for batch_rows, batch_grids in ((rows, grids), ([[50, 51, 52], [60, 61]], [None, None])):
            inputs = qwen_inputs(batch_rows, batch_grids)
            vanilla, spec = greedy_runs(lm, drafter, inputs, 8)
            reference = transformers_greedy(model, inputs, 8)
            assert [t.tolist() for t in vanilla.tokens] == reference == [t.tolist() for t in spec.tokens], kind


def test_tree_verification_equals_the_forward_of_each_path():
    from vlm_dummies import TREE_PATHS, verify_example_tree

    model = tiny_qwen_vl(seed=2)
    inputs = qwen_inputs(ROWS[:2], GRIDS[:2])
    tokens, logits = verify_example_tree(cached_vlm(model), inputs)
    offset = 0
    with torch.no_grad():
        for b in range(2):
            n = int(inputs.attention_mask[b].sum())
            g = inputs.extras["image_grid_thw"][b: b + 1]
            pixels = inputs.pixel_values[offset: offset + int(g.prod())]
            offset += int(g.prod())
            for node, path in TREE_PATHS.items():
                seq = torch.cat([inputs.input_ids[b: b + 1, :n], tokens[b: b + 1, path]], dim=1)
                ref = model(input_ids=seq, pixel_values=pixels, image_grid_thw=g,
                            mm_token_type_ids=(seq == IMAGE_PAD).int()).logits[0, -1].float()
                torch.testing.assert_close(logits[b, node], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("primitive", ["prune", "pool", "conv", "resample"])
def test_greedy_specvlm_equals_transformers_generate_on_images_of_three_sizes(primitive):
    """SpecVLM pools each image on its own merged patch grid (from image_grid_thw), the gate forced to one
    primitive; a text-only row rides along."""
    from vlm.specvlm import PRIMITIVES

    model = tiny_qwen_vl()
    rows, grids = [ROWS[0], [40, 41, 42, 43, 44], ROWS[1], ROWS[2]], [GRIDS[0], None, GRIDS[1], GRIDS[2]]
    inputs = qwen_inputs(rows, grids)
    reference = transformers_greedy(model, inputs, 10)
    lm = cached_vlm(model)
    merge = model.config.vision_config.spatial_merge_size
    assert lm.image_grids(inputs, None) == [[(0, h // merge, w // merge, w // merge)] for h, w in GRIDS]
    torch.manual_seed(1)
    drafter = drafter_model("specvlm").for_target(lm).eval()
    with torch.no_grad():
        drafter.gate[-1].bias[PRIMITIVES.index(primitive)] = 50.0
    spec = greedy_runs(lm, drafter, inputs, 10)[1]
    assert [t.tolist() for t in spec.tokens] == reference
    kept = drafter.last_kept.tolist()
    assert kept[1] == 0 and drafter.last_choice[0] == PRIMITIVES.index(primitive)
    if primitive in ("pool", "conv"):
        sides = [(-(-h // merge // 2), -(-w // merge // 2)) for h, w in GRIDS]  # 2 x 2 windows, partial at borders
        assert [kept[0], kept[2], kept[3]] == [a * b for a, b in sides]


def test_speculative_vlm_loads_a_qwen2_vl_folder_and_equals_transformers_generate(tmp_path):
    """The world Qwen2-VL (untrained, tiny) with its own processor saved as a transformers folder: SpeculativeVLM
    loads it, formats prompts with Qwen2-VL's vision delimiters, mixes a text-only row with image rows, and its
    greedy answers (vanilla and ViSpec) equal transformers' `generate` on the processor's own outputs."""
    from transformers import Qwen2VLForConditionalGeneration

    from vlm.pipeline import SpeculativeVLM
    from vlm.world import world_vqa_examples
    from vlm.world_qwen2_vl import world_qwen2_vl_config, world_qwen2_vl_processor

    torch.manual_seed(0)
    config = world_qwen2_vl_config(vision=dict(depth=1, embed_dim=32, num_heads=2),
                                   text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=2))
    Qwen2VLForConditionalGeneration(config).save_pretrained(tmp_path)
    world_qwen2_vl_processor().save_pretrained(tmp_path)
    vlm = SpeculativeVLM.from_pretrained(tmp_path, torch_dtype=torch.float32)  # transformers' older dtype name
    assert vlm.model.dtype == torch.float32
    examples = world_vqa_examples("test", 3, seed=0)
    images = [examples[0].image, None, examples[2].image]
    prompts = [examples[0].qa.question, "What is in the world?", examples[2].qa.question]
    assert vlm.prompt_text(prompts[0]) == f"USER: <|vision_start|><|image_pad|><|vision_end|>\n{prompts[0]} ASSISTANT:"
    reference = []
    for image, prompt in zip(images, prompts):
        text = vlm.prompt_text(prompt, image is not None)
        enc = vlm.processor(images=None if image is None else [image], text=[text], return_tensors="pt")
        gen = vlm.model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=0)  # stops at <eos>
        reference.append(gen[0, enc["input_ids"].shape[1]:].tolist())
    vanilla = vlm.generate(images, prompts, max_new_tokens=8, use_drafter=False)
    vlm.drafter = drafter_model("vispec").for_target(vlm.lm).eval()
    spec = vlm.generate(images, prompts, max_new_tokens=8, budget="fixed")
    assert vanilla.token_ids == reference == spec.token_ids


def test_sampled_second_token_follows_the_target_law_with_a_negative_control():
    """300 copies of one image prompt sample three tokens at temperature 1 with EAGLE trees (the second token is
    the first drafted one, verified by rejection sampling at M-RoPE positions): its counts, grouped by the first
    token, fit transformers' own conditional softmax (pooled chi-square); the same counts against the softmax at
    temperature 0.8 (a near miss) must fail, so the test can tell."""
    from transformers import Qwen2VLForConditionalGeneration

    from mmspec.testing.distributions import assert_fits_law_not_control
    from vlm.pipeline import SpeculativeVLM
    from vlm.world import world_vqa_examples
    from vlm.world_qwen2_vl import world_qwen2_vl_config, world_qwen2_vl_processor

    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(world_qwen2_vl_config(
        vision=dict(depth=1, embed_dim=32, num_heads=2),
        text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2))).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaked laws: a few first tokens, each with enough samples
    vlm = SpeculativeVLM(model, world_qwen2_vl_processor())
    vlm.drafter = drafter_model("eagle").for_target(vlm.lm).eval()
    example = world_vqa_examples("test", 1, seed=0)[0]
    n = 300
    enc = vlm.processor(images=[example.image] * n, text=[vlm.prompt_text(example.qa.question)] * n,
                        padding=True, return_tensors="pt")
    out = vlm.generate(**enc, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                       tree=(2, 4, 8), budget="fixed", generator=torch.Generator().manual_seed(1))
    p = enc["input_ids"].shape[1]
    pairs = out[:, p: p + 2].tolist()
    assert vlm.last_stats.num_drafts > 0

    def law(temperature: float):
        def next_probs(first: int):
            one = {k: v[:1] for k, v in enc.items() if k != "pixel_values"}
            ids = torch.cat([one["input_ids"], torch.tensor([[first]])], dim=1)
            types = torch.cat([one["mm_token_type_ids"], torch.zeros(1, 1, dtype=torch.long)], dim=1)
            with torch.no_grad():
                logits = model(input_ids=ids, pixel_values=enc["pixel_values"][: int(one["image_grid_thw"].prod())],
                               image_grid_thw=one["image_grid_thw"], mm_token_type_ids=types).logits[0, -1]
            return torch.softmax(logits.double() / temperature, -1).numpy()
        return next_probs

    assert_fits_law_not_control(pairs, law, 0.8, min_dof=2)
