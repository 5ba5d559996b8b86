"""Tiny LLaVA models and right-padded prompt batches for the VLM tests (built from configs, never downloaded)."""

from __future__ import annotations

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from vlm.target import VLMInputs

IMAGE_TOKEN, IMAGE_SEQ, VOCAB = 4, 16, 99


def tiny_llava(strategy: str = "default", seed: int = 0) -> LlavaForConditionalGeneration:
    torch.manual_seed(seed)
    patches = 17 if strategy == "full" else 16
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=2),
        text_config=LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
        image_token_index=IMAGE_TOKEN, image_seq_length=patches, vision_feature_select_strategy=strategy,
        vision_feature_layer=-2)
    return LlavaForConditionalGeneration(cfg).eval()


def prompt(text_before: list[int], text_after: list[int], n_image: int) -> list[int]:
    return [1] + text_before + [IMAGE_TOKEN] * n_image + text_after


def batch(rows: list[list[int]], pixel_values: torch.Tensor) -> VLMInputs:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return VLMInputs(ids, mask, pixel_values)


def greedy_vanilla_and_tree(lm, tree_cls, drafter, rows: list[list[int]], pixels: torch.Tensor, steps: int = 12):
    """Greedy vanilla decoding and greedy EAGLE-2 tree drafting (top_k 3, depth 3, 8 nodes) with `tree_cls` over
    the same right-padded batch: (vanilla output, speculative output)."""
    from mmspec.lm import LMTarget, NoDrafter
    from mmspec.loop import generate
    from mmspec.sampling import SamplingParams
    from vlm.target import prefill_vlm

    params, b = SamplingParams(temperature=0.0), len(rows)
    vanilla = generate(LMTarget(lm, params, steps, prefill_fn=prefill_vlm), NoDrafter(), "greedy",
                       batch(rows, pixels), batch_size=b, max_new_tokens=steps)
    tree = tree_cls(drafter, lm, params, top_k=3, depth=3, total_tokens=8)
    spec = generate(LMTarget(lm, params, steps, max_draft_nodes=8, prefill_fn=prefill_vlm), tree, "lossless",
                    batch(rows, pixels), batch_size=b, max_new_tokens=steps)
    return vanilla, spec


def assert_root_is_the_layout_forward(lm, drafter, rows: list[list[int]], pixels: torch.Tensor, layout_forward,
                                      features_of=lambda lm: lm.last_hidden) -> None:
    """After the loop drafter's `begin` on `rows`, the root pair's output of each row equals the last element of
    `layout_forward(layout)` [1, L', H] over ViSpec's layout (`vlm.vispec.vispec_layout`) of the row's prompt and
    its first token: the drafter's training view. `features_of(lm)`: the target features the drafter reads."""
    from mmspec.lm import LMTarget
    from mmspec.loop import DecodeState
    from mmspec.sampling import SamplingParams
    from vlm.target import prefill_vlm
    from vlm.vispec import vispec_layout

    inputs = batch(rows, pixels)
    LMTarget(lm, SamplingParams(temperature=0.0), 4, prefill_fn=prefill_vlm).prefill(inputs)
    features, embeds = features_of(lm).clone(), lm.prompt_embeds.clone()  # [B, P, F], [B, P, H]
    tree = drafter.loop_drafter(drafter, lm, SamplingParams(temperature=0.0), top_k=2, depth=2, total_tokens=4)
    state = DecodeState.new(len(rows), 4, "cpu")
    state.last_token = torch.arange(40, 40 + len(rows))
    tree.begin(inputs, state)
    _, root_hidden, _ = tree.run_pending()
    for b, r in enumerate(rows):
        n = len(r)
        ids = torch.tensor([r + [int(state.last_token[b])]])
        seq_embeds = torch.cat([embeds[b: b + 1, :n], lm.text.embed_tokens(state.last_token[b: b + 1])[:, None]], 1)
        seq_features = torch.cat([features[b: b + 1, :n], torch.zeros(1, 1, features.shape[-1])], 1)  # never read
        with torch.no_grad():
            h = layout_forward(vispec_layout(drafter, ids, seq_embeds, seq_features, IMAGE_TOKEN))
        torch.testing.assert_close(root_hidden[b], h[0, -1], atol=1e-5, rtol=1e-5)


TREE_PATHS = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3]}  # node -> root-to-node path of `verify_example_tree`


def verify_example_tree(lm, inputs: VLMInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill two rows, then ONE verify forward over a 4-node draft tree per row (node 0 the root = the last
    token; nodes 1, 2 children of 0; node 3 a child of 1). Returns (tokens [2, 4], logits [2, 4, V]); a node's
    logits must equal the model's forward of the prompt + its TREE_PATHS tokens."""
    from mmspec.lm import LMTarget
    from mmspec.sampling import SamplingParams
    from mmspec.tree import DraftTree
    from vlm.target import prefill_vlm

    target = LMTarget(lm, SamplingParams(temperature=1.0), max_new_tokens=8, prefill_fn=prefill_vlm)
    target.prefill(inputs)
    tokens = torch.tensor([[21, 30, 31, 32], [22, 40, 41, 42]])
    parents = torch.tensor([[-1, 0, 0, 1]] * 2)
    depths = torch.tensor([[0, 1, 1, 2]] * 2)
    tree = DraftTree(tokens, parents, depths, torch.ones(2, 4, dtype=torch.bool), max_depth=2, max_children=2)
    runner = target.runner
    logits = runner.forward(tokens, tree.position_ids(runner.lengths), runner.slots(4),
                            tree_mask=tree.attention_mask())
    return tokens, logits


def assert_tree_logits_match_llava(model, rows: list[list[int]], pixels: torch.Tensor) -> None:
    """`verify_example_tree` on a LLaVA target: each node's logits == transformers' forward of prompt + path."""
    from vlm.target import LlavaCachedLM

    tokens, logits = verify_example_tree(LlavaCachedLM(model), batch(rows, pixels))
    with torch.no_grad():
        for b, r in enumerate(rows):
            for node, path in TREE_PATHS.items():
                seq = torch.tensor([r + tokens[b, path].tolist()])
                ref = model(input_ids=seq, pixel_values=pixels[b: b + 1]).logits[0, -1].float()
                torch.testing.assert_close(logits[b, node], ref, atol=1e-5, rtol=1e-5)


def stop_ids(vlm) -> set[int]:
    """The ids that end an answer: the tokenizer's eos and the model's generation_config's."""
    ids = vlm.model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    return ids | {vlm.processor.tokenizer.eos_token_id} - {None}


def appended_token_law(model, enc: dict, temperature: float):
    """next_probs(first) for `pooled_chi_square`: the model's own softmax at `temperature` of the token after row 0
    of a processor's outputs `enc` plus `first` (one token, or a tuple of tokens: a prefix from `prefix_pairs`);
    input_ids get them, attention_mask 1s, token_type_ids 0s."""
    extra = {"input_ids": None, "attention_mask": 1, "token_type_ids": 0}

    def next_probs(first: int | tuple[int, ...]):
        added = torch.tensor([first if isinstance(first, tuple) else (first,)])  # [1, n]
        one = {k: v[:1] for k, v in enc.items()}
        for key, fill in extra.items():
            if key in one:
                value = added if fill is None else torch.full_like(added, fill)
                one[key] = torch.cat([one[key], value.to(one[key].dtype)], dim=1)
        with torch.no_grad():
            logits = model(**one).logits[0, -1]
        return torch.softmax(logits.double() / temperature, -1).numpy()

    return next_probs


def save_tiny_world_llava(folder, text_layers: int = 2, seed: int = 0):
    """A tiny random world LLaVA (width 32, `text_layers` text layers) with the world processor saved in `folder`,
    the layout `mmspec train vlm` writes; returns the folder."""
    from vlm.world import world_llava_config, world_processor

    torch.manual_seed(seed)
    config = world_llava_config(vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2),
                                text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=text_layers,
                                          num_attention_heads=4, num_key_value_heads=2))
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    world_processor().save_pretrained(folder)
    return folder


def interrupted_at(real_step, at: int):
    """A trainer's `optimizer_step` that stops the run with KeyboardInterrupt at step `at` (a kill, for a test)."""

    def step_or_stop(opt, loss, step, *args, **kwargs):
        if step == at:
            raise KeyboardInterrupt
        real_step(opt, loss, step, *args, **kwargs)

    return step_or_stop
