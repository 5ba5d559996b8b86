"""What every acceptance rule shares: drafts, randomness, the result type, the rule base class and registry.

A rule is a named mode with parameters (like vLLM's rejection-sample methods), not a fork of the pipeline:
`get_rule("lossless")`, `get_rule("lantern", neighbours=table, delta=0.1)`, `get_rule("gsd", group_size=50)`.
Rules implement `verify_chain` and/or `verify_tree` as pure tensor functions of their inputs and the
pre-drawn randomness; `mmspec.verify.accept` validates the inputs and draws the randomness.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmspec.errors import InputError, check_distribution
from mmspec.sampling import Generators, exponential, uniform
from mmspec.tree import DraftTree


@dataclass
class ChainDraft:
    """K drafted tokens per row, with the draft distribution they were sampled from (or None = one-hot)."""

    tokens: torch.Tensor  # [B, K] int64, -1 past num_draft
    probs: torch.Tensor | None = None  # [B, K, V] q, or None for drafts without a distribution
    num_draft: torch.Tensor | None = None  # [B] int64 drafts per row (ragged); None = K for every row

    def resolved_num_draft(self) -> torch.Tensor:
        if self.num_draft is not None:
            return self.num_draft
        b, k = self.tokens.shape
        return torch.full((b,), k, dtype=torch.long, device=self.tokens.device)


Draft = ChainDraft | DraftTree


@dataclass
class Randomness:
    """Pre-drawn randomness for one verify call: one uniform per draft position / tree node, one Exp(1)
    vector per row for the race that samples the recovered or bonus token (only one of them is used)."""

    uniforms: torch.Tensor  # [B, K] (chain) or [B, N] (tree), float64 in [0, 1)
    exponentials: torch.Tensor  # [B, V] float64 > 0

    @staticmethod
    def draw(batch: int, positions: int, vocab: int, generator: Generators = None,
             device: torch.device | str = "cpu") -> Randomness:
        """Draw per row: row b's numbers come from generator b when a list is given (batch-independent)."""
        return Randomness(uniform((batch, positions), generator, device),
                          exponential((batch, vocab), generator, device))


@dataclass
class VerifyResult:
    """The outcome of one verify call for a batch.

    output_tokens   [B, K+1] accepted drafts, then the recovered/bonus token, then -1 (tree: K = max depth)
    num_accepted    [B] drafted tokens accepted (excluding the recovered/bonus token)
    accepted_flags  [B, K] per draft position (tree: per depth along the accepted path)
    num_drafted     [B] positions that could have been accepted (chain: drafts; tree: depth of the row's tree)
    accepted_nodes  [B, K+1] tree only: node indices of the accepted path, root first, -1 padded
    """

    output_tokens: torch.Tensor
    num_accepted: torch.Tensor
    accepted_flags: torch.Tensor
    num_drafted: torch.Tensor
    accepted_nodes: torch.Tensor | None = None

    @property
    def num_emitted(self) -> torch.Tensor:
        """[B] tokens this call adds per row: accepted + 1 (the recovered or bonus token)."""
        return self.num_accepted + 1

    @property
    def final_tokens(self) -> torch.Tensor:
        """[B] the recovered or bonus token of each row."""
        return self.output_tokens.gather(1, self.num_accepted.unsqueeze(-1)).squeeze(-1)


class AcceptanceRule:
    """Base class: subclasses set `name`, `lossless`, and implement the shapes they support; a rule whose
    exactness depends on its parameters overrides `keeps_distribution`, and one that needs more of its inputs than
    a distribution over the vocabulary extends `check_inputs`."""

    name: str = "base"
    lossless: bool = False  # output distribution equals the target's exactly (with the rule's parameters)
    uses_randomness: bool = True
    supports_chain: bool = True
    supports_tree: bool = True
    # a step without drafts samples the token from p with the lossless rule's randomness (the same tokens), so the
    # loop's plain steps take that path whatever the rule's cost on an empty draft
    plain_step_samples_p: bool = False
    # at temperature 0 the rule reads the target's softmax of its (guided, constrained) logits, not the one-hot argmax
    # (a relaxed greedy rule such as LANTERN's moves mass between tokens; `mmspec.lm.LMTarget.soft_greedy`)
    greedy_reads_softmax: bool = False
    # on a one-branch tree of deterministic drafts (`DraftTree.is_chain`) the tree form gives the chain form's
    # tokens from the same numbers (node i's uniform is the chain's draft i - 1's), so `accept` runs the chain form
    chain_form_on_chain_trees: bool = False

    @classmethod
    def keeps_distribution(cls, **params) -> bool:
        """Whether a rule built with these constructor parameters keeps the target's distribution exactly (what a
        method record reports as `lossless` before anything is built). Default: the class's `lossless`."""
        return cls.lossless

    def check_inputs(self, target_probs: torch.Tensor) -> None:
        """Check the target's distributions [B, positions, V] for this rule (InputError naming the problem):
        probabilities by default; rules with tables over the vocabulary also check the tables cover V."""
        check_distribution("target_probs (p)", target_probs)

    def verify_chain(self, draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, rand: Randomness,
                     num_draft: torch.Tensor) -> VerifyResult:
        raise InputError(f"acceptance rule {self.name!r} does not verify chains; use a tree draft.")

    def verify_tree(self, tree: DraftTree, target_probs: torch.Tensor, rand: Randomness) -> VerifyResult:
        raise InputError(f"acceptance rule {self.name!r} does not verify trees; use a chain draft.")

    def config(self) -> dict:
        """The rule's parameters (JSON-serialisable), for stats and reports."""
        return {"name": self.name}

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({params})"


_RULES: dict[str, type[AcceptanceRule]] = {}


def register_rule(cls: type[AcceptanceRule]) -> type[AcceptanceRule]:
    """Class decorator: make a rule available to `get_rule(cls.name, ...)`."""
    _RULES[cls.name] = cls
    return cls


def available_rules() -> list[str]:
    return sorted(_RULES)


def rule_class(name: str) -> type[AcceptanceRule]:
    """The rule class registered as `name` (InputError listing the rules otherwise)."""
    if name not in _RULES:
        raise InputError(f"unknown acceptance rule {name!r}; available: {', '.join(available_rules())}.")
    return _RULES[name]


def rule_keeps_distribution(name: str, params: dict) -> bool:
    """`keeps_distribution` of rule `name` with the entries of `params` its constructor takes."""
    import inspect

    cls = rule_class(name)
    taken = inspect.signature(cls.__init__).parameters
    return cls.keeps_distribution(**{k: v for k, v in params.items() if k in taken})


def get_rule(name: str | AcceptanceRule, **params) -> AcceptanceRule:
    """A rule by name with its parameters, e.g. `get_rule("lantern", neighbours=table, delta=0.1)`."""
    if isinstance(name, AcceptanceRule):
        if params:
            raise InputError("pass parameters either to get_rule with a name, or to the rule's constructor.")
        return name
    cls = rule_class(name)
    try:
        return cls(**params)
    except TypeError as err:
        raise InputError(f"bad parameters for acceptance rule {name!r}: {err}") from None
