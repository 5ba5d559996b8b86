"""VAR's multi-scale VQVAE: shapes, encode/decode round trip, straight-through training step, save/load, and
clear errors."""

import pytest
import torch

from image_ar.var.vqvae import VARVQVAE
from mmspec.errors import InputError


def tiny() -> VARVQVAE:
    torch.manual_seed(0)
    return VARVQVAE(vocab_size=16, z_channels=4, ch=8, ch_mult=(1, 2), num_res_blocks=1, norm_num_groups=4,
                    patch_nums=(1, 2, 4)).eval()


def test_encode_decode_shapes_and_pyramid():
    vae = tiny()
    images = torch.rand(2, 3, 8, 8) * 2 - 1
    pyramid = vae.encode(images)
    assert [p.shape for p in pyramid] == [(2, 1), (2, 4), (2, 16)]
    assert all(int(p.min()) >= 0 and int(p.max()) < 16 for p in pyramid)
    with torch.no_grad():
        out = vae.decode(pyramid)
    assert out.shape == (2, 3, 8, 8) and float(out.abs().max()) <= 1.0
    inputs = vae.quantize.teacher_inputs(pyramid)
    assert inputs.shape == (2, 4 + 16, 4)  # the inputs of scales 1 and 2: 2x2 + 4x4 positions


def test_training_step_moves_encoder_codebook_and_phi():
    vae = tiny().train()
    images = torch.rand(2, 3, 8, 8) * 2 - 1
    rec, vq_loss = vae(images)
    ((rec - images).pow(2).mean() + vq_loss).backward()
    assert vae.encoder.conv_in.weight.grad.abs().sum() > 0  # straight-through reaches the encoder
    assert vae.quantize.embedding.weight.grad.abs().sum() > 0
    assert vae.quantize.quant_resi.qresi_ls[0].weight.grad.abs().sum() > 0
    assert vae.decoder.conv_out.weight.grad.abs().sum() > 0


def test_straight_through_output_equals_the_quantised_features():
    vae = tiny()
    f = vae.features(torch.rand(1, 3, 8, 8) * 2 - 1)
    f_st, _ = vae.quantize(f)
    torch.testing.assert_close(f_st, vae.quantize.decode_pyramid(vae.quantize.encode(f)), rtol=1e-5, atol=1e-5)


def test_save_and_load_round_trip(tmp_path):
    vae = tiny()
    vae.save_pretrained(tmp_path / "vae")
    loaded = VARVQVAE.from_pretrained(tmp_path / "vae").eval()
    images = torch.rand(1, 3, 8, 8) * 2 - 1
    assert [torch.equal(a, b) for a, b in zip(loaded.encode(images), vae.encode(images))] == [True] * 3


def test_wrong_image_size_and_bad_groups_are_clear_errors():
    with pytest.raises(InputError, match=r"\[B, 3, 8, 8\]"):
        tiny().encode(torch.zeros(1, 3, 16, 16))
    with pytest.raises(InputError, match="norm_num_groups"):
        VARVQVAE(ch=6, ch_mult=(1,), norm_num_groups=4, patch_nums=(1, 2))
