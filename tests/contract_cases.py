"""One `mmspec.testing.contract.ContractCase` per installed family: a tiny pipeline with every component its
methods need, how a call of a method looks, the parameters under which each lossy method is exact, and the
family's reference (the model library's own decoding, or full forwards) and teacher-forced law."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from mmspec.testing import seeded_generators
from mmspec.testing.contract import ContractCase, ContractRun

HERE = Path(__file__).parent
for folder in ("image_ar", "continuous", "vlm"):  # the families' dummies (diffusers' get_dummy_components)
    if str(HERE / folder) not in sys.path:
        sys.path.insert(0, str(HERE / folder))


def image_call(pipe, conditions: Sequence, method: str, given: Mapping, temperature: float, seed: int,
               budget: str | None, images_per_prompt: int = 1, **call: Any) -> ContractRun:
    """A discrete image pipeline's call of a loop method (latent output: the tokens)."""
    out = pipe(conditions, temperature=temperature, method=method, method_kwargs=dict(given), budget=budget,
               generator=seeded_generators(images_per_prompt * len(conditions), seed), output_type="latent",
               num_images_per_prompt=images_per_prompt, **call)
    return ContractRun(out.tokens, out.stats)


class LlamaGenCase(ContractCase):
    family = "llamagen"
    guidance_scale, law_guidance_scale, top_k, images_per_prompt = 2.5, 2.5, 16, 1
    law_variants = {"sjd": [{"accept": "lossless", "coupling": c} for c in ("gumbel", "maximal")]}
    law_settings = {"eagle": {"top_k": 4, "depth": 3, "total_tokens": 10}}  # a branching tree, cheaper than 59 nodes
    exact = {"draft-model": [{}, {"num_draft_tokens": 3}],
             "sjd": [{}, {"init": "repeat_horizon", "window": 4}, {"init": "sample_horizon"},
                     {"interval": (3, 12), "window": 5}, {"accept": "gsd"}, {"coupling": "maximal"}],
             "gsd": [{}, {"group_size": 1}],
             "eagle": [{}, {"top_k": 3, "depth": 5, "total_tokens": 12}, {"top_k": 9, "depth": 8, "total_tokens": 70}],
             "lantern": [{"delta": 0.0}, {"delta": 0.0, "top_k": 3, "depth": 5, "total_tokens": 12}]}

    def build(self):
        from llamagen_dummies import get_dummy_components

        from image_ar.llamagen.eagle import LlamaGenEagleDrafter
        from image_ar.llamagen.pipeline import LlamaGenPipeline

        components = get_dummy_components()
        torch.manual_seed(1)
        drafter = LlamaGenEagleDrafter.for_target(components["transformer"]).eval()
        pipe = LlamaGenPipeline(**components, eagle_drafter=drafter)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def conditions(self) -> list:
        return [0, 2, 3]

    def exact_given(self, method: str) -> list[dict]:
        return self.exact.get(method, [{}])

    def run(self, pipe, method, given, conditions, *, temperature, seed=0, budget=None, law=False) -> ContractRun:
        return image_call(pipe, list(conditions), method, given, temperature, seed, budget,
                          guidance_scale=self.law_guidance_scale if law else self.guidance_scale, top_k=self.top_k,
                          images_per_prompt=1 if law else self.images_per_prompt)

    def probs_at(self, pipe, condition, tokens, position, temperature):
        from image_ar.llamagen.scoring import target_probs

        return target_probs(pipe, [condition] * tokens.shape[0], tokens, guidance_scale=self.law_guidance_scale,
                            temperature=temperature, top_k=self.top_k)[:, position]

    def library_greedy(self, pipe, conditions):
        """Greedy CFG decoding with full forwards (no cache): the independent reference."""
        from llamagen_dummies import reference_greedy_cfg

        return reference_greedy_cfg(pipe.transformer, list(conditions), self.guidance_scale)


class LlamaGenT2ICase(LlamaGenCase):
    family = "llamagen-t2i"
    guidance_scale, images_per_prompt = 4.0, 2
    law_guidance_scale = 1.5  # a law broad enough for the chi-square's degrees of freedom

    def build(self):
        from llamagen_dummies import get_dummy_t2i_components

        from image_ar.llamagen.pipeline import LlamaGenPipeline

        pipe = LlamaGenPipeline(**get_dummy_t2i_components())
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def conditions(self) -> list:
        return ["a red circle", "two small blue squares on a green background", "a cross"]  # ragged captions

    library_greedy = ContractCase.library_greedy  # no independent reference for the t2i model here


class TransformersImageCase(ContractCase):
    """Janus and Emu3: transformers' own models, the shared method records (eagle / lantern with a random EAGLE
    drafter at the model's width)."""

    fewer_forwards = ("sjd", "gsd")
    guidance_scale, top_k = 5.0, 0
    exact = {"sjd": [{}, {"window": 4, "init": "repeat_horizon"}, {"accept": "gsd"}], "gsd": [{}],
             "lantern": [{"delta": 0.0}]}
    law_variants = {"sjd": [{"accept": "lossless", "coupling": "maximal"}]}
    law_settings = {"eagle": {"top_k": 4, "depth": 3, "total_tokens": 10}}
    call: dict = {}  # the exactness calls' further arguments

    def tiny(self):
        raise NotImplementedError

    def build(self):
        from image_ar.transformers_ar.official import with_eagle_drafter

        pipe = self.tiny()
        pipe.set_progress_bar_config(disable=True)
        torch.manual_seed(1)
        return with_eagle_drafter(pipe, "cpu", torch.float32)

    def conditions(self) -> list:
        return ["a red circle", "two small blue squares on a green background", "a cross"]  # ragged once tokenized

    def exact_given(self, method: str) -> list[dict]:
        return self.exact.get(method, [{}])

    def run(self, pipe, method, given, conditions, *, temperature, seed=0, budget=None, law=False) -> ContractRun:
        return image_call(pipe, list(conditions), method, given, temperature, seed, budget,
                          guidance_scale=self.guidance_scale, top_k=self.top_k, **({} if law else self.call))

    def probs_at(self, pipe, condition, tokens, position, temperature):
        return pipe.target_probs([condition] * tokens.shape[0], tokens, guidance_scale=self.guidance_scale,
                                 temperature=temperature, top_k=self.top_k)[:, position]

    def modules(self, pipe):
        return [pipe.model, pipe.eagle_drafter]


class JanusCase(TransformersImageCase):
    family = "janus"

    def tiny(self):
        from image_ar.transformers_ar.tiny import tiny_janus_pipeline

        return tiny_janus_pipeline()

    def library_greedy(self, pipe, conditions):
        """transformers' own image generation, prompts built as its docs do (chat template, left padding)."""
        proc = pipe.processor
        texts = [proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": p}]}],
                                          add_generation_prompt=True) for p in conditions]
        enc = proc(text=texts, generation_mode="image", padding=True, return_tensors="pt")
        assert (enc["attention_mask"] == 0).any()  # the batch is ragged: left padding is exercised
        return pipe.model.generate(**enc, generation_mode="image", do_sample=False,
                                   guidance_scale=self.guidance_scale)


class Emu3Case(TransformersImageCase):
    family = "emu3"
    guidance_scale, top_k = 3.0, 0
    exact = {**TransformersImageCase.exact, "sjd": [{}, {"window": 6, "init": "repeat_horizon"}, {"accept": "gsd"}]}
    call = {"negative_prompt": "blurry"}  # a plain-text negative prompt (test_emu3.py checks the official one)
    law_variants: dict = {}  # (Janus samples SJD's coupled law; Emu3's 23-token images cost twice its time)

    def tiny(self):
        from image_ar.transformers_ar.tiny import tiny_emu3_pipeline

        return tiny_emu3_pipeline()


class LuminaMGPTCase(TransformersImageCase):
    family = "lumina-mgpt"
    guidance_scale, top_k = 3.0, 0
    exact = {**TransformersImageCase.exact, "sjd": [{}, {"window": 6, "init": "repeat_horizon"}, {"accept": "gsd"}]}
    law_variants: dict = {}  # (Janus samples SJD's coupled law; Lumina's 21-token images cost what Emu3's do)

    def tiny(self):
        from image_ar.transformers_ar.tiny import tiny_lumina_mgpt_pipeline

        return tiny_lumina_mgpt_pipeline()


class VARCase(ContractCase):
    """VAR and CoDe: one forward per scale; CoDe with the same model on both sides is vanilla at every split."""

    family = "var"
    budgets = (None,)
    exact_drafting = False  # CoDe's small model may run on no scale (draft_steps = all of them)

    def build(self):
        from var_dummies import get_dummy_components, small_refiner

        from image_ar.var.code import CoDePipeline

        c = get_dummy_components()
        pipe = CoDePipeline(drafter=c["transformer"], refiner=small_refiner(), vqvae=c["vqvae"])
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def conditions(self) -> list:
        return [0, 1, 2]

    def exact_given(self, method: str) -> list[dict]:
        return [{"draft_steps": s} for s in range(4)] if method == "code" else [{}]

    def exact_pipeline(self, pipe, method):
        from image_ar.var.code import CoDePipeline

        same = CoDePipeline(drafter=pipe.drafter, refiner=pipe.drafter, vqvae=pipe.vqvae)
        same.set_progress_bar_config(disable=True)
        return same

    def run(self, pipe, method, given, conditions, *, temperature, seed=0, budget=None, law=False) -> ContractRun:
        call, extra = self.record.get_method(method).build(pipe, given, self.family)
        out = call(class_labels=list(conditions), temperature=temperature, output_type="latent",
                   generator=seeded_generators(len(conditions), seed), **extra)
        return ContractRun(out.tokens, out.stats)


class MARCase(ContractCase):
    """MAR and CSpD: continuous tokens, so exactness compares seeded samples: CSpD with the target as its own
    draft and windows of one is vanilla MAR."""

    family = "mar"
    exact_temperature = 1.0
    exact_drafting = False

    def build(self):
        from mar_dummies import tiny_mar, tiny_vae

        from continuous.mar.cspd import CSpDPipeline

        pipe = CSpDPipeline(target=tiny_mar(0), draft=tiny_mar(1), vae=tiny_vae())
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def conditions(self) -> list:
        return [0, 3, 1]

    def exact_given(self, method: str) -> list[dict]:
        return [{"gamma": 1}, {"gamma": 1, "criterion": "reference_code"}] if method == "cspd" else [{}]

    def exact_pipeline(self, pipe, method):
        from continuous.mar.cspd import CSpDPipeline

        same = CSpDPipeline(target=pipe.target, draft=pipe.target, vae=pipe.vae)
        same.set_progress_bar_config(disable=True)
        return same

    def run(self, pipe, method, given, conditions, *, temperature, seed=0, budget=None, law=False) -> ContractRun:
        given = dict(given) if budget is None or method == "vanilla" else {**given, "budget": budget}
        call, extra = self.record.get_method(method).build(pipe, given, self.family)
        out = call(class_labels=list(conditions), temperature=temperature, num_sampling_steps=4, output_type="latent",
                   generator=seeded_generators(len(conditions), seed), **extra)
        return ContractRun(out.tokens, out.stats)


class ToyCase(ContractCase):
    """The toy LM through the bench family's runner (`mmspec.bench.toy`)."""

    family = "toy"
    budgets = (None,)
    law_rows = 600
    fewer_forwards = ("self-draft",)  # the target drafting for itself: every greedy draft is accepted

    def settings(self, temperature: float = 0.0, seed: int = 0, n: int = 3):
        from mmspec.bench import BenchSettings

        return BenchSettings(num_samples=n, max_new_tokens=12, temperature=temperature, seed=seed,
                             options={"vocab_size": "16", "prompt_length": "4"})

    def build(self):
        from mmspec.bench.toy import build_toy

        return build_toy(self.settings())

    @cached_property
    def prompts(self) -> list[torch.Tensor]:
        from mmspec.bench.toy import toy_inputs

        return [s.data for s in toy_inputs(self.settings(n=3))]

    def conditions(self) -> list:
        return list(self.prompts)

    def run(self, models, method, given, conditions, *, temperature, seed=0, budget=None, law=False) -> ContractRun:
        from mmspec.bench import Sample
        from mmspec.bench.toy import ToyRun, decode

        settings = self.settings(temperature, seed, len(conditions))
        batch = [Sample(question_id=i, category="toy", data=c) for i, c in enumerate(conditions)]
        drafter, rule = self.record.get_method(method).build(ToyRun(models, batch, settings), given, "toy")
        out = decode(models, batch, settings, drafter, rule)
        return ContractRun(out.outputs, out.stats)

    def probs_at(self, models, condition, tokens, position, temperature):
        from mmspec.lm import GuidedRunner, teacher_forced_probs
        from mmspec.sampling import SamplingParams

        prompts = condition.expand(tokens.shape[0], -1)  # [n, P]
        return teacher_forced_probs(GuidedRunner(models.target), prompts, tokens,
                                    SamplingParams(temperature=temperature))[:, position]

    def modules(self, models):
        return [models.target]


class VLMCase(ContractCase):
    """The LLaVA target with one untrained drafter of each kind (`for_target`), world images and questions."""

    family = "vlm"
    law_rows, law_min_dof = 600, 2  # a random tiny model's law: 600 rows give 8-11 degrees of freedom on 5.6 / 5.23

    def exact_given(self, method: str) -> list[dict]:
        if method == "pld":
            return [{}, {"num_draft_tokens": 3, "max_ngram": 2}]
        if method == "sam":
            return [{}, {"num_draft_tokens": 3}]
        if method == "recycle":
            return [{}, {"candidates": 4, "top_k": 2, "depth": 3, "total_tokens": 6}]
        return [{}] if method == "vanilla" else [{}, {"depth": 3, "top_k": 3, "total_tokens": 8}]
    questions = ["What color is the object?", "Describe the image. Answer in detail.", "How many objects are there?"]

    def build(self) -> dict:
        from transformers import LlavaForConditionalGeneration

        from vlm.family import DRAFTER_KINDS, TRAINING_FREE_KINDS, drafter_model
        from vlm.pipeline import SpeculativeVLM
        from vlm.target import LlavaCachedLM
        from vlm.world import world_llava_config, world_processor

        text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration(world_llava_config(vision=vision, text=text)).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(20.0)  # a peaked next-token law (random tiny models are near uniform)
        pipes = {"vanilla": SpeculativeVLM(model, world_processor())}
        for kind in DRAFTER_KINDS:
            torch.manual_seed(1)
            pipes[kind] = SpeculativeVLM(model, world_processor(), drafter_model(kind).for_target(LlavaCachedLM(model)))
        for kind in TRAINING_FREE_KINDS:  # built from their parameters: one per call's parameters (`run`)
            pipes[kind] = pipes["vanilla"]
        return pipes

    @cached_property
    def images(self) -> list:
        from mmspec.data import generate_batch

        return list(generate_batch(3, seed=0, split="test").images)

    def conditions(self) -> list:
        return list(zip(self.images, self.questions))

    def run(self, pipes, method, given, conditions, *, temperature, seed=0, budget=None, law=False) -> ContractRun:
        record = self.record.get_method(method)
        params = record.resolved(record.check_given(given, "vlm"))
        images, prompts = [c[0] for c in conditions], [c[1] for c in conditions]
        tree = (params["depth"], params["top_k"], params["total_tokens"]) if "depth" in params else None
        pipe = pipes[method]
        if method != "vanilla" and not record.trained:  # a training-free kind, built with this call's parameters
            from vlm.family import training_free_drafter
            from vlm.pipeline import SpeculativeVLM

            pipe = SpeculativeVLM(pipe.model, pipe.processor, training_free_drafter(method, given))
        out = pipe.generate(images, prompts, max_new_tokens=3 if law else 10,
                                     temperature=temperature, tree=tree, batch_size=len(conditions),
                                     generator=torch.Generator().manual_seed(seed), use_drafter=method != "vanilla",
                                     child_ranking=params.get("child_ranking", "raw"), budget=budget,
                                     accept=params.get("accept", "coupled"))
        return ContractRun([torch.tensor(ids) for ids in out.token_ids], out.stats)

    def probs_at(self, pipes, condition, tokens, position, temperature):
        vlm = pipes["vanilla"]
        inputs = vlm.encode([condition[0]], [condition[1]])
        ids = torch.cat([inputs.input_ids.expand(tokens.shape[0], -1), tokens[:, :position]], dim=1)
        with torch.no_grad():
            logits = vlm.model(input_ids=ids, pixel_values=inputs.pixel_values.expand(tokens.shape[0], -1, -1, -1)
                               ).logits[:, -1]  # [n, V]
        return torch.softmax(logits.double() / temperature, -1)

    def modules(self, pipes):
        drafters = [p.drafter for p in pipes.values() if getattr(p, "drafter", None) is not None]
        return [pipes["vanilla"].model, *drafters]


CASES: dict[str, ContractCase] = {case.family: case for case in (
    LlamaGenCase(), LlamaGenT2ICase(), JanusCase(), Emu3Case(), LuminaMGPTCase(), VARCase(), MARCase(), ToyCase(),
    VLMCase())}
