"""The feature drafters' shared pieces (`mmspec.feature_drafter`): ViSpec's ranking and distribution losses against
independent computations, and the child ranking options (raw log-softmax = EAGLE's, processed)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mmspec.errors import InputError
from mmspec.feature_drafter import (
    CHILD_RANKINGS,
    FeatureTreeDrafter,
    distribution_l1_loss,
    feature_drafter_loss,
    topk_ranking_loss,
)
from mmspec.sampling import SamplingParams


def plackett_luce_nll(z: list[float]) -> float:
    """-log P(order) of items with scores z, listed in the order observed (one position)."""
    total = 0.0
    for j in range(len(z)):
        total -= z[j] - math.log(sum(math.exp(v) for v in z[j:]))
    return total


def test_ranking_loss_is_plackett_luce_over_the_targets_top_k():
    torch.manual_seed(0)
    logits, p = torch.randn(2, 3, 12), torch.softmax(torch.randn(2, 3, 12) * 2, -1)
    mask = torch.tensor([[True, False, True], [True, True, False]])
    expected = []
    for b, s in itertools.product(range(2), range(3)):
        if mask[b, s]:
            order = p[b, s].argsort(descending=True)[:5]
            expected.append(plackett_luce_nll(logits[b, s, order].tolist()))
    got = topk_ranking_loss(logits, p, 5, mask)
    assert abs(float(got) - sum(expected) / len(expected)) < 1e-4
    # the draft that orders the target's top-k exactly as the target does scores better than its reverse
    order = p.argsort(-1, descending=True)
    aligned = torch.zeros_like(logits).scatter(-1, order, torch.linspace(5, -5, 12).expand_as(logits).contiguous())
    reverse = torch.zeros_like(logits).scatter(-1, order, torch.linspace(-5, 5, 12).expand_as(logits).contiguous())
    assert topk_ranking_loss(aligned, p, 5) < topk_ranking_loss(reverse, p, 5)


def test_distribution_l1_loss_and_the_ranking_term_of_the_feature_loss():
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 12, bias=False)
    pred, target_logits = torch.randn(2, 4, 8), torch.randn(2, 4, 12)
    loss, l1, rank, agree = distribution_l1_loss(pred, target_logits, head)
    q, p = torch.softmax(head(pred), -1), torch.softmax(target_logits, -1)
    assert torch.allclose(l1, (q - p).abs().sum(-1).mean())
    assert torch.allclose(loss, 10 * l1 + 0.1 * topk_ranking_loss(head(pred), p, 10))
    assert 0 <= float(agree) <= 1
    features = torch.randn(2, 4, 8)
    base = feature_drafter_loss(pred, features, target_logits, head, 0.1)
    ranked = feature_drafter_loss(pred, features, target_logits, head, 0.1, rank_weight=0.1)
    extra = 0.1 * 0.1 * topk_ranking_loss(torch.log_softmax(head(pred), -1), p, 10)
    assert torch.allclose(ranked[0], base[0] + extra, atol=1e-5)


class _Model:
    def __init__(self):
        self.forwards = 0


@pytest.mark.parametrize("ranking", CHILD_RANKINGS)
def test_child_ranking(ranking):
    """raw ranks by the drafter's log-softmax at every temperature (EAGLE); processed after the target's
    temperature and top-k, so a node's cumulative score changes with them."""
    drafter = FeatureTreeDrafter.__new__(FeatureTreeDrafter)
    drafter.params, drafter.child_ranking = SamplingParams(temperature=0.5, top_k=2), ranking
    drafter.layout = None
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])  # [B, F, V]
    got = drafter.log_probs(logits, torch.tensor([0]))
    raw = torch.log_softmax(logits, -1)
    if ranking == "raw":
        assert torch.allclose(got, raw)
    else:
        assert torch.isinf(got[0, 0, 2:]).all() and not torch.allclose(got[0, 0, :2], raw[0, 0, :2])


def test_children_are_ranked_among_the_tokens_the_layout_allows_at_their_index():
    from mmspec.lm import TokenLayout

    drafter = FeatureTreeDrafter.__new__(FeatureTreeDrafter)
    drafter.params, drafter.child_ranking = SamplingParams(temperature=0.0), "raw"
    allowed = torch.tensor([[True, True, False, False], [False, False, True, True]])
    drafter.layout = TokenLayout(kinds=torch.tensor([0, 1, 0]), allowed=allowed)  # index 1 allows tokens 2, 3
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]], [[2.0, 1.0, 0.0, -1.0]]])  # [B=2, F=1, V]
    got = drafter.log_probs(logits, torch.tensor([1, 2]))  # row 0's children are index 1, row 1's index 2
    assert torch.isinf(got[0, 0, :2]).all() and got[0, 0, 2:].exp().sum().item() == pytest.approx(1.0)
    assert torch.isinf(got[1, 0, 2:]).all() and got[1, 0, :2].exp().sum().item() == pytest.approx(1.0)


def test_unknown_child_ranking_is_refused():
    with pytest.raises(InputError, match="child_ranking"):
        FeatureTreeDrafter(_Model(), None, SamplingParams(temperature=0.0), top_k=2, depth=2, total_tokens=4,
                           position_offset=0, child_ranking="sorted")
