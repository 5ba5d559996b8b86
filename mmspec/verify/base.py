"""What every acceptance rule shares: drafts, randomness, the result type, the rule base class and registry.

A rule is a named mode with parameters (like vLLM's rejection-sample methods), not a fork of the pipeline:
`get_rule("lossless")`, `get_rule("lantern", neighbours=table, delta=0.1)`, `get_rule("gsd", group_size=50)`.
Rules implement `verify_chain` and/or `verify_tree` as pure tensor functions of their inputs and the
pre-drawn randomness; `mmspec.verify.accept` validates the inputs and draws the randomness.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mmspec.errors import InputError, check_distribution
from mmspec.noise import KeyedNoise
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
    """The randomness of one verify call: one uniform per draft position / tree node, and the Exp(1) vector of the
    race that samples the token a row emits after its accepted drafts (`exponentials_at`). Either given (`draw`:
    `exponentials` [B, V], whatever that token's index) or position-keyed (`keyed`: the numbers of each token index,
    `mmspec.noise`; the uniforms hashed at their first read, so a rule that reads none, e.g. `coupled`, pays none)."""

    given_uniforms: torch.Tensor | None  # [B, K] (chain) or [B, N] (tree), float64 in (0, 1); None: keyed
    exponentials: torch.Tensor | None = None  # [B, V] float64 > 0, or None: keyed by index
    noise: KeyedNoise | None = None  # the call's keyed noise
    positions: torch.Tensor | None = None  # [B] token index of the first token this call decides
    vocab: int = 0
    uniform_index: torch.Tensor | None = None  # keyed: [B, K] or [B, N] the token index of each uniform
    uniform_sub: torch.Tensor | int = 0  # keyed: its sub-key ([B, N] a tree's node ids)

    @property
    def uniforms(self) -> torch.Tensor:
        """[B, K] or [B, N] the acceptance uniforms (keyed ones hashed once, at the first read)."""
        if self.given_uniforms is None:
            index = self.uniform_index
            self.given_uniforms = (self.noise.uniforms(index, "accept", self.uniform_sub) if index.numel()
                                   else torch.empty(index.shape, dtype=torch.float64, device=index.device))
        return self.given_uniforms

    def from_second(self) -> Randomness:
        """The numbers with the first uniform of each row left out (a chain tree's node i is draft i - 1)."""
        if self.given_uniforms is not None:
            return replace(self, given_uniforms=self.given_uniforms[:, 1:])
        sub = self.uniform_sub[:, 1:] if isinstance(self.uniform_sub, torch.Tensor) else self.uniform_sub
        return replace(self, uniform_index=self.uniform_index[:, 1:], uniform_sub=sub)

    def exponentials_at(self, num_accepted: torch.Tensor) -> torch.Tensor:
        """[B, V] Exp(1) of the token after num_accepted [B] accepted drafts: at index positions + num_accepted,
        the "sample" noise (a plain step's token and vanilla's use the same numbers)."""
        if self.exponentials is not None:
            return self.exponentials
        index = (self.positions + num_accepted).unsqueeze(-1)  # [B, 1]
        return self.noise.exponentials(index, "sample", self.vocab)[:, 0]

    @staticmethod
    def draw(batch: int, positions: int, vocab: int, generator: Generators = None,
             device: torch.device | str = "cpu") -> Randomness:
        """Draw per row: row b's numbers come from generator b when a list is given (batch-independent)."""
        return Randomness(uniform((batch, positions), generator, device),
                          exponential((batch, vocab), generator, device))

    @staticmethod
    def keyed(noise: KeyedNoise, positions: torch.Tensor, draft: Draft, vocab: int) -> Randomness:
        """The call's numbers at their token indices: a chain draft j's uniform at index positions + j, a tree node's
        at positions + its depth - 1 (the node id tells siblings apart), the emitted token's at its own index."""
        if isinstance(draft, ChainDraft):
            index = positions.unsqueeze(-1) + torch.arange(draft.tokens.shape[1], device=positions.device)  # [B, K]
            return Randomness(None, None, noise, positions, vocab, index)
        index = positions.unsqueeze(-1) + draft.depths - 1  # [B, N]
        nodes = torch.arange(draft.num_nodes, device=positions.device).expand_as(index)  # [B, N]
        return Randomness(None, None, noise, positions, vocab, index, nodes)


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
    # the rule accepts a draft when it is the target's own sample at its index: drafters then draw with the target's
    # "sample" noise (`mmspec.noise.KeyedNoise.draft_exponentials`), so a draft is that sample where their laws agree
    couples_drafts: bool = False
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
