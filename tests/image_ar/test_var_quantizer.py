"""VAR's residual multi-scale quantiser: Phi selection ticks, the encoding formulas by hand, reconstruction,
teacher-forcing inputs == inference's next inputs, and the wiring with the transformer."""

import pytest
import torch
import torch.nn.functional as F

from image_ar.var import VARTransformer
from image_ar.var.quantizer import MultiScaleQuantizer
from mmspec.errors import InputError

OFFICIAL = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)


def test_phi_of_each_scale_follows_the_official_ticks():
    q = MultiScaleQuantizer(16, 4, OFFICIAL)
    # ticks (1/12, 13/36, 23/36, 11/12) vs si/9; scales 2 and 7 sit exactly between two ticks (left out)
    expected = {0: 0, 1: 0, 3: 1, 4: 1, 5: 2, 6: 2, 8: 3, 9: 3}
    assert {si: q.phi_of_scale[si] for si in expected} == expected
    assert len(q.quant_resi.qresi_ls) == 4 and "quant_resi.qresi_ls.3.weight" in q.state_dict()
    assert MultiScaleQuantizer(16, 4, (1, 2), share_quant_resi=2).phi_of_scale == [0, 1]


def test_phi_mixes_identity_and_convolution():
    q = MultiScaleQuantizer(16, 4, (1, 2))
    phi = q.quant_resi.qresi_ls[0]
    h = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(phi(h), 0.5 * h + 0.5 * F.conv2d(h, phi.weight, phi.bias, padding=1))


def test_encoding_follows_the_residual_formulas_by_hand():
    torch.manual_seed(0)
    q = MultiScaleQuantizer(64, 3, (1, 2), quant_resi=0.0)  # Phi = identity
    f = torch.randn(2, 3, 2, 2)
    idx0, idx1 = q.encode(f)
    codes = q.embedding.weight
    mean = f.mean((2, 3))  # area-downsample to 1x1
    assert torch.equal(idx0[:, 0], torch.cdist(mean, codes).argmin(-1))
    up = codes[idx0[:, 0]][:, :, None, None].expand(-1, -1, 2, 2)  # bicubic of a 1x1 map is constant
    rest = (f - up).permute(0, 2, 3, 1).reshape(-1, 3)
    assert torch.equal(idx1.reshape(-1), torch.cdist(rest, codes).argmin(-1))


def test_more_codes_reconstruct_better():
    torch.manual_seed(1)
    f = torch.randn(4, 2, 4, 4)
    errors = []
    for v in (4, 512):
        q = MultiScaleQuantizer(v, 2, (1, 2, 4), quant_resi=0.0)
        with torch.no_grad():
            errors.append(float((q.decode_pyramid(q.encode(f)) - f).pow(2).mean()))
    assert errors[1] < 0.5 * errors[0] and errors[1] < 0.1 * float(f.pow(2).mean())


def test_teacher_inputs_equal_the_inference_inputs_and_the_formula():
    torch.manual_seed(2)
    q = MultiScaleQuantizer(32, 3, (1, 2, 4))
    pyramid = q.encode(torch.randn(2, 3, 4, 4))
    inputs = q.teacher_inputs(pyramid)  # [2, 4 + 16, 3]
    assert inputs.shape == (2, 20, 3)
    first = q.phi(0, F.interpolate(q.embedding(pyramid[0]).transpose(1, 2).reshape(2, 3, 1, 1), size=(4, 4),
                                   mode="bicubic"))
    torch.testing.assert_close(inputs[:, :4], F.interpolate(first, size=(2, 2), mode="area").flatten(2).transpose(1, 2))
    f_hat, steps = torch.zeros(2, 3, 4, 4), []
    for si, idx in enumerate(pyramid):
        f_hat, nxt = q.next_input(si, f_hat, idx)
        if nxt is not None:
            steps.append(nxt)
    torch.testing.assert_close(torch.cat(steps, 1), inputs)
    torch.testing.assert_close(f_hat, q.decode_pyramid(pyramid))


def test_transformer_teacher_forcing_equals_its_inference_loop_on_quantizer_inputs():
    torch.manual_seed(3)
    pns = (1, 2, 4)
    q = MultiScaleQuantizer(32, 3, pns)
    model = VARTransformer(vocab_size=32, cvae=3, num_classes=4, depth=2, embed_dim=16, num_heads=2,
                           patch_nums=pns).eval()
    pyramid = q.encode(torch.randn(2, 3, 4, 4))
    labels = torch.tensor([1, 2])
    with torch.no_grad():
        full = model(labels, q.teacher_inputs(pyramid))
        cond, cache = model.condition(labels), model.new_cache(2)
        h, f_hat, steps = model.first_token_map(cond), torch.zeros(2, 3, 4, 4), []
        for si in range(len(pns)):
            steps.append(model.forward_cached(h, cond, cache, si))
            f_hat, nxt = q.next_input(si, f_hat, pyramid[si])
            if nxt is not None:
                h = model.embed_inputs(nxt, model.bounds[si + 1][0])
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_wrong_feature_shape_is_a_clear_error():
    q = MultiScaleQuantizer(8, 3, (1, 2))
    with pytest.raises(InputError, match=r"\[B, 3, 2, 2\]"):
        q.encode(torch.randn(1, 3, 4, 4))


def test_restart_dead_codes_moves_only_unused_codes_onto_residual_vectors():
    torch.manual_seed(0)
    q = MultiScaleQuantizer(8, 3, (1, 2), quant_resi=0.0)  # Phi = identity: the residuals are easy to list
    with torch.no_grad():
        q.embedding.weight[4:] = 1000.0  # codes 4..7 are far from everything: never picked
    f = torch.randn(2, 3, 2, 2)
    before = q.embedding.weight.detach().clone()
    used = torch.unique(torch.cat([idx.flatten() for idx in q.encode(f)]))
    mean = f.mean((2, 3))  # scale 0's residual vectors (1x1), then scale 1's: f minus the scale-0 code
    up = before[q.encode(f)[0][:, 0]][:, :, None, None]
    pool = torch.cat([mean, (f - up).permute(0, 2, 3, 1).reshape(-1, 3)])
    moved = q.restart_dead_codes(f, torch.Generator().manual_seed(1))
    dead = [c for c in range(8) if c not in used.tolist()]
    assert moved == len(dead) and set(range(4, 8)) <= set(dead)
    after = q.embedding.weight.detach()
    assert torch.equal(after[used], before[used])  # live codes untouched
    for c in dead:  # every moved code now sits on one of the walk's residual vectors
        assert torch.isclose(pool, after[c]).all(-1).any()
