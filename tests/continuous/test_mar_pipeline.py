"""MAR and CSpD pipelines on tiny models: the shared pipeline tests (`mmspec.testing.pipeline_tester`), the diffusion
arithmetic samples the right distribution, the ragged encoder equals the per-row one, CSpD's exact special cases
(gamma 1 with the target as draft, full pre-filling) equal vanilla MAR, ragged windows fill every token, the phases
of CSpD's loop are timed, clear errors."""

import math

import pytest
import torch
from mar_dummies import generators, tiny_mar, tiny_vae

from continuous.mar.cspd import CSpDPipeline
from continuous.mar.diffusion import GaussianDiffusion, respaced_timesteps
from continuous.mar.pipeline import MARPipeline, step_sizes
from mmspec.errors import InputError
from mmspec.phases import record_phases
from mmspec.testing.budgets import CyclingBudget
from mmspec.testing.pipeline_tester import PipelineTesterMixin
from mmspec.verify.cspd import CSpDRule


def test_respacing_is_the_official_even_spacing():
    steps = respaced_timesteps(100)
    assert steps[:3].tolist() == [0, 10, 20] and steps[-1].item() == 999 and len(steps) == 100


@pytest.mark.parametrize("num_steps", [100, 1000])
def test_sampling_with_the_exact_eps_recovers_a_gaussian(num_steps):
    """x0 ~ N(m, s^2) has the exact eps predictor sqrt(1-ab) (x_t - sqrt(ab) m) / (ab s^2 + 1 - ab); DDPM sampling
    with it (posterior variance, v = -1) must return N(m, s^2)."""
    m, s = 0.7, 0.5
    diffusion = GaussianDiffusion(num_steps)
    alphas = diffusion.training_chain.alphas_cumprod.float()

    def eps_fn(x, t, step):
        ab = alphas[t].unsqueeze(-1)
        eps = (1 - ab).sqrt() * (x - ab.sqrt() * m) / (ab * s * s + 1 - ab)
        return torch.cat([eps, -torch.ones_like(x)], -1)

    gen = torch.Generator().manual_seed(0)
    n = 20_000
    traj = diffusion.sample(eps_fn, torch.randn(n, 2, generator=gen), torch.randn(num_steps, n, 2, generator=gen))
    assert traj.x0.mean().item() == pytest.approx(m, abs=0.02)
    assert traj.x0.std().item() == pytest.approx(s, abs=0.02)
    assert torch.equal(traj.x0, traj.last_mean) and traj.log_variances.shape == (num_steps, n, 2)


def test_diffusion_loss_trains():
    model = tiny_mar(0).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    tokens = 0.5 * torch.randn(8, model.seq_len, 16, generator=gen)
    labels = torch.arange(8) % 5  # 4 = the null class
    losses = []
    for _ in range(30):
        loss = model.training_loss(tokens, labels, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert math.isfinite(losses[-1]) and sum(losses[-5:]) < sum(losses[:5])


def test_ragged_encoder_equals_each_row_alone():
    model = tiny_mar(1)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randn(3, model.seq_len, 16, generator=gen)
    known = torch.zeros(3, model.seq_len, dtype=torch.bool)
    known[0, :5], known[1, [1, 7, 9]], known[2, 2:12] = True, True, True
    cond = model.condition(torch.tensor([0, 4, 2]))
    z = model.predict(tokens, known, cond)
    for b in range(3):
        alone = model.predict(tokens[b:b + 1], known[b:b + 1], cond[b:b + 1])
        torch.testing.assert_close(z[b:b + 1], alone, atol=1e-5, rtol=1e-5)


def test_step_schedule_covers_every_token():
    for num_iter in (1, 4, 16):
        sizes = step_sizes(num_iter, 16)
        assert sum(n for n, _ in sizes) == 16 and all(n >= 1 for n, _ in sizes) and len(sizes) == num_iter
    assert [n for n, _ in step_sizes(16, 16)] == [1] * 16


class TestMARPipeline(PipelineTesterMixin):
    pipeline_class = MARPipeline
    image_shape, token_shape, num_classes = (16, 16), (16, 16), 4
    batch_tolerance = 1e-4  # the ragged encoder's batched arithmetic
    inference_steps_name = "num_sampling_steps"
    extra_bad_inputs = (({"num_iter": 99}, "num_iter must be an integer in"),
                        ({"guidance_scale": 0.5}, "guidance_scale must be a number >= 1.0"),
                        ({"cfg_schedule": "cosine"}, "cfg_schedule"))

    def get_dummy_components(self) -> dict:
        return {"transformer": tiny_mar(2), "vae": tiny_vae()}

    def get_dummy_inputs(self) -> dict:
        return {"num_sampling_steps": 4}


class TestCSpDPipeline(PipelineTesterMixin):
    pipeline_class = CSpDPipeline
    image_shape, token_shape, num_classes = (16, 16), (16, 16), 4
    batch_tolerance = 1e-4
    inference_steps_name = "num_sampling_steps"
    extra_bad_inputs = (({"temperature": 0}, "temperature must be > 0"), ({"gamma": 0}, "gamma"))

    def get_dummy_components(self) -> dict:
        return {"target": tiny_mar(2), "draft": tiny_mar(3, embed_dim=16), "vae": tiny_vae()}

    def get_dummy_inputs(self) -> dict:
        return {"gamma": 2, "num_sampling_steps": 4, "budget": "fixed"}  # seeded calls repeat with a fixed window


@pytest.fixture(scope="module")
def pipe():
    p = CSpDPipeline(target=tiny_mar(2), draft=tiny_mar(3, embed_dim=16), vae=tiny_vae())
    p.set_progress_bar_config(disable=True)
    return p


def test_fewer_iterations_predict_several_tokens_per_step(pipe):
    fewer = pipe.as_mar_pipeline("target")(class_labels=[0, 1, 2], generator=generators(3), num_iter=4,
                                           num_sampling_steps=10, output_type="latent")
    assert fewer.num_forwards == 4 and fewer.tokens.abs().sum(-1).gt(0).all()


@pytest.mark.parametrize("which", ["mar", "cspd"])
def test_one_generator_and_a_list_of_it_give_a_batch_of_one_the_same_image(pipe, which):
    call = pipe.as_mar_pipeline("target") if which == "mar" else pipe
    kw = dict(class_labels=[2], num_sampling_steps=4, output_type="pt", **({"gamma": 2} if which == "cspd" else {}))
    alone = call(generator=torch.Generator().manual_seed(7), **kw)
    listed = call(generator=[torch.Generator().manual_seed(7)], **kw)
    assert torch.equal(alone.tokens, listed.tokens) and torch.equal(alone.images, listed.images)


def test_cspd_loop_phases_are_timed(pipe):
    with record_phases("cpu") as times:
        out = pipe(class_labels=[0, 1], generator=generators(2), gamma=3, num_sampling_steps=3, output_type="latent")
    assert set(times.calls) == {"prefill", "draft", "verify", "accept", "commit"}
    assert times.calls["verify"] == out.stats.num_target_forwards - math.ceil(0.05 * pipe.target.seq_len)


def test_cspd_with_the_target_as_draft_and_gamma_1_is_vanilla_mar(pipe):
    same = CSpDPipeline(target=pipe.target, draft=pipe.target, vae=pipe.vae)
    same.set_progress_bar_config(disable=True)
    kw = dict(class_labels=[0, 3], num_sampling_steps=10, output_type="latent")
    vanilla = pipe.as_mar_pipeline("target")(generator=generators(2), **kw).tokens
    out = same(generator=generators(2), gamma=1, **kw)
    assert torch.equal(out.tokens, vanilla)
    assert out.stats.draft_acceptance_rate == 1.0
    # all pre-filled by the target: vanilla MAR whatever the draft
    full = pipe(generator=generators(2), prefill_ratio=1.0, **kw)
    assert torch.equal(full.tokens, vanilla) and full.stats.num_target_forwards == pipe.target.seq_len


@pytest.mark.parametrize("rule", [CSpDRule(), CSpDRule.reference_code()], ids=["paper", "reference_code"])
def test_cspd_ragged_windows_fill_every_token(pipe, rule):
    seq = pipe.target.seq_len
    out = pipe(class_labels=[0, 1, 2], generator=generators(3), gamma=3, num_sampling_steps=5, rule=rule,
               output_type="latent", budget="fixed")
    assert torch.isfinite(out.tokens).all() and out.tokens.abs().sum(-1).gt(0).all()  # no token left unset
    stats = out.stats
    prefill = math.ceil(0.05 * seq)
    assert stats.num_emitted_tokens == 3 * (seq - prefill)
    assert stats.num_target_forwards == prefill + stats.num_draft_forwards // 3
    again = pipe(class_labels=[0, 1, 2], generator=generators(3), gamma=3, num_sampling_steps=5, rule=rule,
                 output_type="latent", budget="fixed")
    assert torch.equal(out.tokens, again.tokens)


def test_window_budget_plain_steps_are_vanilla_mar_and_windows_vary(pipe, monkeypatch):
    """Under a window budget a plain step is the target's own next token: all plain steps == vanilla MAR with one
    token per step; windows that change every step still fill every token; budget="auto" times the windows once and
    keeps what it learnt between calls (the default, CSpD's relaxed rule, drafts gamma every step)."""
    kw = dict(class_labels=[0, 3, 1], num_sampling_steps=4, output_type="latent", budget="auto")
    vanilla = pipe.as_mar_pipeline("target")(generator=generators(3), class_labels=[0, 3, 1], num_sampling_steps=4,
                                             output_type="latent").tokens
    monkeypatch.setattr("continuous.mar.cspd.cspd_budget", lambda *args: CyclingBudget([0]))
    plain = pipe(generator=generators(3), gamma=4, **kw)
    assert torch.equal(plain.tokens, vanilla) and plain.stats.num_draft_forwards == 0
    assert plain.stats.num_target_forwards == pipe.target.seq_len
    monkeypatch.setattr("continuous.mar.cspd.cspd_budget", lambda *args: CyclingBudget([0, 3, 1, 2]))
    mixed = pipe(generator=generators(3), gamma=4, **kw)
    assert mixed.tokens.abs().sum(-1).gt(0).all() and {"budget_0", "budget_3", "budget_1"} <= set(mixed.stats.extra)
    assert mixed.stats.num_emitted_tokens == 3 * (pipe.target.seq_len - math.ceil(0.05 * pipe.target.seq_len))
    monkeypatch.undo()
    pipe.budgets.clear()
    auto = pipe(generator=generators(3), gamma=4, **kw)
    assert auto.tokens.abs().sum(-1).gt(0).all() and any(k.startswith("budget_") for k in auto.stats.extra)
    pipe(generator=generators(3), gamma=4, **kw)
    assert len(pipe.budgets) == 1 and sum(next(iter(pipe.budgets.values())).chosen.values()) > 0
    pipe.budgets.clear()
    fixed = pipe(generator=generators(3), gamma=4, **{**kw, "budget": None})
    assert not pipe.budgets and not any(k.startswith("budget_") for k in fixed.stats.extra)
    with pytest.raises(InputError, match="budget must be one of"):
        pipe(generator=generators(3), gamma=4, **{**kw, "budget": "fast"})


def test_window_budget_call_gate_and_settling(pipe, monkeypatch):
    """CSpD's loop speaks to a budget as `mmspec.loop.generate` does (`mmspec.budget.BudgetCall`): a gated call runs
    as vanilla MAR without asking the budget (no draft forwards); a budget that settles on plain steps is not asked
    again in that call; the budget hears the call's end."""
    from mmspec.budget import SETTLE

    kw = dict(class_labels=[0, 3], num_sampling_steps=4, output_type="latent", budget="auto")
    seq = pipe.target.seq_len
    decoded = seq - math.ceil(0.05 * seq)  # tokens after the target's pre-filling
    vanilla = pipe.as_mar_pipeline("target")(generator=generators(2), class_labels=[0, 3], num_sampling_steps=4,
                                             output_type="latent").tokens

    class Gated(CyclingBudget):
        def begin(self, target, drafter, state, rule):
            return False

        def end(self):
            self.ended = True

    gated = Gated([3])
    monkeypatch.setattr("continuous.mar.cspd.cspd_budget", lambda *args: gated)
    out = pipe(generator=generators(2), gamma=4, **kw)
    assert torch.equal(out.tokens, vanilla) and out.stats.num_draft_forwards == 0 and gated.step == 0
    assert out.stats.extra["calls_without_drafter"] == 1 and out.stats.extra["budget_0"] == decoded and gated.ended

    class Settling(CyclingBudget):
        def choose(self, rows_held, tokens_left):
            super().choose(rows_held, tokens_left)
            return SETTLE if self.step >= 2 else 0

    settling = Settling([0])
    monkeypatch.setattr("continuous.mar.cspd.cspd_budget", lambda *args: settling)
    out = pipe(generator=generators(2), gamma=4, **kw)
    assert torch.equal(out.tokens, vanilla) and settling.step == 2 and out.stats.extra["budget_0"] == decoded


def test_alignment_changes_the_drafts_noise_only(pipe):
    kw = dict(class_labels=[0, 1], gamma=2, num_sampling_steps=5, output_type="latent", prefill_ratio=0.0,
              budget="fixed")
    aligned, unaligned = pipe(generator=generators(2), **kw), pipe(generator=generators(2), align=False, **kw)
    assert not torch.equal(aligned.tokens, unaligned.tokens)


def test_unset_guidance_and_schedule_are_the_models_defaults(pipe):
    """guidance_scale / cfg_schedule left None: the (target) model's default_guidance_scale / default_cfg_schedule
    (official 3.0 linear unless the config says otherwise, as the world models do)."""
    kw = dict(class_labels=[0, 3], num_sampling_steps=4, output_type="latent")
    mar = pipe.as_mar_pipeline("target")
    official = mar(generator=generators(2), **kw).tokens
    assert torch.equal(official, mar(generator=generators(2), guidance_scale=3.0, cfg_schedule="linear", **kw).tokens)
    tuned = MARPipeline(transformer=tiny_mar(2, default_guidance_scale=2.0, default_cfg_schedule="constant"),
                        vae=pipe.vae)
    tuned.set_progress_bar_config(disable=True)
    own = tuned(generator=generators(2), **kw).tokens
    assert torch.equal(own, tuned(generator=generators(2), guidance_scale=2.0, cfg_schedule="constant", **kw).tokens)
    assert not torch.equal(own, official)  # same weights (seed 2), other sampling settings
    cspd = CSpDPipeline(target=tuned.transformer, draft=pipe.draft, vae=pipe.vae)
    cspd.set_progress_bar_config(disable=True)
    explicit = cspd(generator=generators(2), gamma=2, guidance_scale=2.0, cfg_schedule="constant", budget="fixed",
                    **kw).tokens
    assert torch.equal(cspd(generator=generators(2), gamma=2, budget="fixed", **kw).tokens, explicit)
    with pytest.raises(InputError, match="default_cfg_schedule must be one of"):
        tiny_mar(2, default_cfg_schedule="cosine")
    with pytest.raises(InputError, match="default_guidance_scale must be a number >= 1.0"):
        tiny_mar(2, default_guidance_scale=0.5)


def test_mismatched_models_are_clear_errors(pipe):
    with pytest.raises(InputError, match="token grid"):
        CSpDPipeline(target=pipe.target, draft=tiny_mar(4, num_classes=7), vae=pipe.vae)
    with pytest.raises(InputError, match="vae_stride"):
        MARPipeline(transformer=tiny_mar(5, vae_stride=2, img_size=8), vae=pipe.vae)
