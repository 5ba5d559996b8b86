"""The VLM family record: the LLaVA target folder, its bench hook, and its methods, declared once here
(`mmspec.families`): `vanilla` (the target alone) and one method per drafter kind, whose `run` is the drafter model
class (loaded from `MODEL/drafters/<kind>` or built for a target with `for_target`; its `loop_drafter` is what the
loop runs). The trained kinds (`DRAFTER_KINDS`: eagle, vispec, msd, specvlm, eagle3) take the EAGLE-2 tree's parameters
(top_k, depth, total_tokens; None = the drafter's paper tree, `official_tree`) and child_ranking
(`VLMEagleTreeDrafter`); the training-free ones (`TRAINING_FREE_KINDS`: pld, prompt lookup; sam, its suffix
automaton; recycle, Token Recycling: `vlm.lookup`) are built from their own parameters, no folder needed. Every
method is lossless, with the exact acceptance mode `accept` ("lossless" or "coupled"). `mmspec vlm`, `mmspec train
vlm-drafter`, the bench and the VLM demo read the kinds from here.
"""

from __future__ import annotations

from pathlib import Path

from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import check
from mmspec.families import DrafterMethod, FamilyRecord, parameters_of
from vlm.eagle import VLMEagleDrafter, VLMEagleTreeDrafter
from vlm.eagle3 import VLMEagle3Drafter
from vlm.lookup import VLMPromptLookup, VLMSuffixLookup, VLMTokenRecycling
from vlm.msd import VLMMSDDrafter
from vlm.specvlm import VLMSpecVLMDrafter
from vlm.vispec import VLMViSpecDrafter

TREE = parameters_of(VLMEagleTreeDrafter)  # top_k, depth, total_tokens, child_ranking
ACCEPT = {"accept": "coupled"}  # the exact acceptance mode: "coupled" or "lossless" (`SamplingParams.exact_rule`)


def load(model_path: str | None, device: str, dtype=None):
    from vlm.pipeline import SpeculativeVLM

    return SpeculativeVLM.from_pretrained(model_path or ASSETS_DIR / "vlm", device=device, dtype=dtype)


def bench():
    from vlm.bench import vlm_family

    return vlm_family()


def profile(pipe) -> dict:
    """The target and every drafter saved with it, as the loop runs them (`vlm.profile`)."""
    from vlm.profile import profile_runners

    return profile_runners(pipe, pipe.folder)


FAMILY = FamilyRecord("vlm", "LLaVA long answers about world scenes with speculative drafters (exactness, answers)",
                      default_model=ASSETS_DIR / "vlm", load=load, bench=bench, profile=profile,
                      method_kind=DrafterMethod)
FAMILY.add("vanilla", None, {}, description="the LLaVA target alone")
for kind, model, what in (("eagle", VLMEagleDrafter, "EagleVLM drafter"),
                          ("vispec", VLMViSpecDrafter, "ViSpec drafter (compressed image token + global feature)"),
                          ("msd", VLMMSDDrafter, "MSD drafter (raw visual embeddings at image positions)"),
                          ("specvlm", VLMSpecVLMDrafter, "SpecVLM drafter (gated elastic visual compressor)"),
                          ("eagle3", VLMEagle3Drafter, "EAGLE-3 drafter (three fused target layers, its own head)")):
    FAMILY.add(kind, model, {**TREE, **ACCEPT}, description=f"{what}, EAGLE-2 dynamic tree, lossless tree verification")
FAMILY.add("pld", VLMPromptLookup, {**parameters_of(VLMPromptLookup), **ACCEPT}, trained=False,
           description="prompt lookup: chains copied from the row's own prompt and answer (no model, no training)")
FAMILY.add("sam", VLMSuffixLookup, {**parameters_of(VLMSuffixLookup), **ACCEPT}, trained=False,
           description="SAM decoding: the row's longest repeated suffix continued, by a suffix automaton (no model)")
FAMILY.add("recycle", VLMTokenRecycling, {**parameters_of(VLMTokenRecycling), **ACCEPT}, trained=False,
           description="Token Recycling: trees from the target's own earlier next-token rankings (no model)")

DRAFTER_KINDS = tuple(n for n, m in FAMILY.methods.items() if n != "vanilla" and m.trained)  # saved in drafters/
TRAINING_FREE_KINDS = tuple(n for n, m in FAMILY.methods.items() if n != "vanilla" and not m.trained)
ALL_KINDS = DRAFTER_KINDS + TRAINING_FREE_KINDS


def drafter_model(kind: str) -> type:
    """The drafter model class of method `kind` (InputError naming the kinds otherwise)."""
    check(kind in ALL_KINDS, f"unknown drafter kind {kind!r}; available: {', '.join(ALL_KINDS)}.")
    return FAMILY.methods[kind].drafter_model


def training_free_drafter(kind: str, given: dict | None = None):
    """A training-free kind's drafter built with the method's parameters (`given` on its defaults; the acceptance
    mode is the call's, not the drafter's)."""
    check(kind in TRAINING_FREE_KINDS,
          f"{kind!r} is not a training-free drafter kind ({', '.join(TRAINING_FREE_KINDS)}).")
    params = FAMILY.methods[kind].resolved(given)
    return drafter_model(kind)(**{k: v for k, v in params.items() if k not in ACCEPT})


def drafter_kinds_in(folder: str | Path) -> list[str]:
    """The kinds with a saved drafter in FOLDER/drafters/<kind>, in the record's order."""
    return [k for k in DRAFTER_KINDS if (Path(folder) / "drafters" / k / "config.json").is_file()]
