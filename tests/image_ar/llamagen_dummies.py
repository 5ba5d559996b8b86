"""Tiny LlamaGen pipeline components for tests (diffusers' get_dummy_components): class-conditional, and
text-conditional with a tiny T5 encoder and a word-level tokenizer built offline; the full-forward greedy CFG
reference."""

import torch

from image_ar.llamagen.eagle import LlamaGenEagleDrafter
from image_ar.llamagen.gpt import LlamaGenGPT
from image_ar.llamagen.vq import LlamaGenVQ
from mmspec.sampling import cfg_combine

WORDS = ["a", "small", "large", "red", "blue", "green", "circle", "square", "cross", "on", "background", "the"]


def get_dummy_components(seed: int = 0, block_size: int = 16) -> dict:
    torch.manual_seed(seed)
    gpt = dict(vocab_size=64, n_head=2, block_size=block_size, num_classes=4, class_dropout_prob=0.1, multiple_of=16)
    transformer = LlamaGenGPT(dim=32, n_layer=2, **gpt).eval()
    draft = LlamaGenGPT(dim=16, n_layer=1, **gpt).eval()
    for model in (transformer, draft):  # official init zeroes the head; give the dummies peaky random outputs
        torch.nn.init.normal_(model.output.weight, std=0.5)
    vqvae = LlamaGenVQ.tiny(downsample_factor=4, codebook_size=64).eval()
    return {"transformer": transformer, "vqvae": vqvae, "draft_transformer": draft}


def tiny_t5_tokenizer(max_length: int = 8):
    """A word-level T5-style tokenizer (pad 0, eos 1, unk 2; EOS appended as T5 does), saved and loaded as a
    transformers `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=max_length)


def get_dummy_t2i_components(seed: int = 0) -> dict:
    """A tiny t2i LlamaGen (8 caption tokens of width 16) with a T5 encoder, tokenizer, draft model and EAGLE
    drafter."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    gpt = dict(vocab_size=64, n_head=2, block_size=16, model_type="t2i", cls_token_num=8, caption_dim=16,
               multiple_of=16)
    transformer = LlamaGenGPT(dim=32, n_layer=2, **gpt).eval()
    draft = LlamaGenGPT(dim=16, n_layer=1, **gpt).eval()
    for model in (transformer, draft):
        torch.nn.init.normal_(model.output.weight, std=0.5)
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(WORDS) + 3, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                           num_heads=2, dropout_rate=0.0)).eval()
    return {"transformer": transformer, "vqvae": LlamaGenVQ.tiny(downsample_factor=4, codebook_size=64).eval(),
            "draft_transformer": draft, "eagle_drafter": LlamaGenEagleDrafter.for_target(transformer).eval(),
            "text_encoder": text_encoder, "tokenizer": tiny_t5_tokenizer()}


@torch.no_grad()
def reference_greedy_cfg(transformer: LlamaGenGPT, labels: list[int], scale: float) -> torch.Tensor:
    """Greedy CFG decoding of class labels with full forwards (no cache): the independent reference [B, L]."""
    cond = torch.tensor(labels)
    uncond = torch.full_like(cond, transformer.config.num_classes)
    tokens = torch.zeros(len(labels), 0, dtype=torch.long)
    for _ in range(transformer.config.block_size):
        idx = torch.cat([tokens, torch.zeros(len(labels), 1, dtype=torch.long)], 1)  # position t predicts token t
        logits = cfg_combine(transformer(idx, cond).logits[:, -1], transformer(idx, uncond).logits[:, -1], scale)
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
    return tokens
