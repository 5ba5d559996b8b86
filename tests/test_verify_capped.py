"""The `capped` rule (Lumina-mGPT 2.0's SJD code: q capped at `cap` in the residual): its declared law, the
lossless rule's tokens when the cap is 1, and a negative control."""

import pytest
import torch

from mmspec.errors import InputError
from mmspec.testing.distributions import empirical_distribution, tv_distance, tv_tolerance
from mmspec.verify import CappedRule, ChainDraft, accept, get_rule, rule_keeps_distribution

V = 6


def sure_problem(n: int):
    """One draft position where p and q both exceed the cap 0.5 on token 0 (where the cap changes the law; with the
    code's 0.99 the change is below 1 - 0.99 in total variation, too small to see in a test), drafts x ~ q."""
    p = torch.tensor([0.6, 0.3, 0.1, 0.0, 0.0, 0.0]).expand(n, 2, V).contiguous()  # [n, K + 1, V]
    q_row = torch.tensor([0.9, 0.05, 0.0, 0.05, 0.0, 0.0])
    x = torch.multinomial(q_row, n, replacement=True, generator=torch.Generator().manual_seed(1)).unsqueeze(-1)
    return p, q_row.expand(n, 1, V).contiguous(), x, q_row


def declared_law(p: torch.Tensor, q: torch.Tensor, cap: float) -> torch.Tensor:
    """min(p, q) + (1 - sum min(p, q)) norm(max(p - min(q, cap), 0))."""
    both = torch.minimum(p, q)
    residual = (p - q.clamp_max(cap)).clamp_min(0)
    return both + (1 - both.sum()) * residual / residual.sum()


def test_the_emitted_token_follows_the_declared_law_not_the_target():
    n = 400_000
    p, q, x, q_row = sure_problem(n)
    out = accept(CappedRule(cap=0.5), ChainDraft(x, q), p, torch.Generator().manual_seed(2)).output_tokens[:, 0]
    emp = empirical_distribution(out, V)
    law = declared_law(p[0, 0], q_row, 0.5)
    assert tv_distance(emp, law) < tv_tolerance(V, n)
    assert tv_distance(law, p[0, 0]) > 5 * tv_tolerance(V, n)  # the cap moves mass here...
    assert tv_distance(emp, p[0, 0]) > 3 * tv_tolerance(V, n)  # ...and the test sees it (negative control)


def test_cap_one_is_the_lossless_rule_token_for_token():
    n = 2000
    p_rows = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 2, -1)
    q_rows = torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(1)) * 2, -1)
    x = torch.multinomial(q_rows, n, replacement=True, generator=torch.Generator().manual_seed(2)).T
    p, q = p_rows.expand(n, 3, V), q_rows.expand(n, 2, V)
    capped = accept(CappedRule(cap=1.0), ChainDraft(x, q), p, torch.Generator().manual_seed(3))
    lossless = accept("lossless", ChainDraft(x, q), p, torch.Generator().manual_seed(3))
    assert torch.equal(capped.output_tokens, lossless.output_tokens)
    assert rule_keeps_distribution("capped", {"cap": 1.0}) and not rule_keeps_distribution("capped", {})


def test_trees_and_bad_caps_are_one_line_errors():
    with pytest.raises(InputError, match="cap must be a number > 0"):
        get_rule("capped", cap=0)
    assert not CappedRule.supports_tree and get_rule("capped").config() == {"name": "capped", "cap": 0.99}
