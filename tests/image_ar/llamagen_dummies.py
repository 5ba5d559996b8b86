"""Tiny LlamaGen pipeline components for tests (diffusers' get_dummy_components)."""

import torch

from image_ar.llamagen.gpt import LlamaGenGPT
from image_ar.llamagen.vq import LlamaGenVQ


def get_dummy_components(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    gpt = dict(vocab_size=64, n_head=2, block_size=16, num_classes=4, class_dropout_prob=0.1, multiple_of=16)
    transformer = LlamaGenGPT(dim=32, n_layer=2, **gpt).eval()
    draft = LlamaGenGPT(dim=16, n_layer=1, **gpt).eval()
    for model in (transformer, draft):  # official init zeroes the head; give the dummies peaky random outputs
        torch.nn.init.normal_(model.output.weight, std=0.5)
    vqvae = LlamaGenVQ.tiny(downsample_factor=4, codebook_size=64).eval()
    return {"transformer": transformer, "vqvae": vqvae, "draft_transformer": draft}
