"""Chain verification: speculative sampling over a chain of K drafted tokens, batched with ragged drafts.

One function does the bookkeeping every chain rule shares (`verify_chain`): count the accepted prefix with
the cumsum trick, gather the target distribution at the first rejection, sample the recovered token from the
rule's residual (or the bonus token from p when every draft was accepted) by the exponential race, and lay
out the outputs padded with -1. A rule only says which drafts it accepts and what its residual is.

Pure functions: randomness comes in as tensors (uniforms [B, K], exponentials [B, V], float64) or, for the emitted
token's exponentials, as a pure function of the accepted counts (`Exponentials`: position-keyed noise, the numbers of
the token's own index), so they are deterministic and compile with `torch.compile(fullgraph=True)`.

Glossary: accepted = drafts kept; recovered = token sampled from the residual at the first rejection; bonus =
token sampled from p after the last draft when all were accepted. Accepted length (reported) = accepted + 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmspec.sampling import race

# accept_fn(draft_tokens [B,K], target_probs [B,K+1,V], draft_probs [B,K,V]|None, uniforms [B,K]) -> [B,K] bool
AcceptFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]
# residual_fn(p_j [B,V], q_j [B,V]|None, x_j [B]) -> unnormalised weights [B,V] >= 0
ResidualFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]
# the emitted token's Exp(1) draws: [B, V], or a function of num_accepted [B] giving them (`Randomness.exponentials_at`)
Exponentials = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


def exponentials_for(exponentials: Exponentials, num_accepted: torch.Tensor) -> torch.Tensor:
    """[B, V] Exp(1) draws of the token each row emits after num_accepted [B] drafts."""
    return exponentials if isinstance(exponentials, torch.Tensor) else exponentials(num_accepted)


def count_leading(flags: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True along the last axis: [B, K] bool -> [B] int64."""
    return ((~flags).cumsum(-1) == 0).sum(-1)


def gather_draft_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs [B, K, V] at tokens [B, K] (-1 allowed, gives 0) -> [B, K]."""
    safe = tokens.clamp_min(0).unsqueeze(-1)  # [B, K, 1]
    return probs.gather(-1, safe).squeeze(-1) * (tokens >= 0)


def lossless_accept(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                    draft_probs: torch.Tensor | None, uniforms: torch.Tensor) -> torch.Tensor:
    """Accept x_i iff U_i < min(1, p_i(x_i) / q_i(x_i)), written U_i * q_i(x_i) < p_i(x_i) (no division).

    One-hot drafts (q None) have q_i(x_i) = 1: acceptance probability p_i(x_i).
    """
    k = draft_tokens.shape[-1]
    p_x = gather_draft_probs(target_probs[:, :k], draft_tokens).double()  # [B, K]
    if draft_probs is None:
        return uniforms < p_x
    q_x = gather_draft_probs(draft_probs, draft_tokens).double()  # [B, K]
    return uniforms * q_x < p_x


def lossless_residual(p_j: torch.Tensor, q_j: torch.Tensor | None, x_j: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)); for a one-hot draft that is p with the rejected token removed."""
    if q_j is None:
        return p_j.scatter(-1, x_j.clamp_min(0).unsqueeze(-1), 0.0)
    return (p_j - q_j).clamp_min(0)


def plain_step_result(token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs of a step without drafts whose token [B] is chosen: ([B, 1] token, [B] zeros, [B, 0] flags)."""
    return token.unsqueeze(-1), torch.zeros_like(token), token.new_zeros(token.shape[0], 0, dtype=torch.bool)


def verify_chain(
    draft_tokens: torch.Tensor,  # [B, K] int64, -1 past num_draft
    target_probs: torch.Tensor,  # [B, K+1, V] p at each draft position plus the bonus position
    draft_probs: torch.Tensor | None,  # [B, K, V] q, or None for one-hot drafts
    uniforms: torch.Tensor,  # [B, K] float64 in [0, 1)
    exponentials: Exponentials,  # [B, V] float64 Exp(1), or a function of num_accepted [B] giving them
    num_draft: torch.Tensor,  # [B] int64 in [0, K]: drafts per row (ragged)
    accept_fn: AcceptFn = lossless_accept,
    residual_fn: ResidualFn = lossless_residual,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared chain bookkeeping. Returns (output_tokens [B, K+1], num_accepted [B], accepted_flags [B, K]).

    output_tokens holds the accepted drafts, then the recovered or bonus token, then -1.
    """
    b, k = draft_tokens.shape
    if k == 0:  # a plain step: the token is sampled from p (no residual, nothing to lay out)
        none = torch.zeros(b, dtype=torch.long, device=draft_tokens.device)
        return plain_step_result(race(target_probs[:, 0], exponentials_for(exponentials, none)))
    positions = torch.arange(k, device=draft_tokens.device)  # [K]
    drafted = positions < num_draft.unsqueeze(-1)  # [B, K]
    accepted = accept_fn(draft_tokens, target_probs, draft_probs, uniforms) & drafted  # [B, K]
    num_accepted = count_leading(accepted)  # [B]

    rows = torch.arange(b, device=draft_tokens.device)
    p_j = target_probs[rows, num_accepted]  # [B, V]
    j_draft = num_accepted.clamp_max(k - 1) if k > 0 else num_accepted
    x_j = draft_tokens[rows, j_draft] if k > 0 else torch.full_like(num_accepted, -1)  # [B]
    q_j = None if draft_probs is None or k == 0 else draft_probs[rows, j_draft]  # [B, V]
    rejected = (num_accepted < num_draft).unsqueeze(-1)  # [B, 1]
    weights = torch.where(rejected, residual_fn(p_j, q_j, x_j), p_j)  # [B, V]
    # numerically empty residual (p == q up to rounding): rejection had ~0 probability; fall back to p
    empty = weights.sum(-1, keepdim=True) <= 0
    weights = torch.where(empty, p_j, weights)
    final_token = race(weights, exponentials_for(exponentials, num_accepted))  # [B]

    out_positions = torch.arange(k + 1, device=draft_tokens.device)  # [K+1]
    padded_drafts = torch.cat([draft_tokens, draft_tokens.new_full((b, 1), -1)], dim=1)  # [B, K+1]
    keep = out_positions < num_accepted.unsqueeze(-1)
    output = torch.where(keep, padded_drafts, torch.full_like(padded_drafts, -1))
    output = torch.where(out_positions == num_accepted.unsqueeze(-1), final_token.unsqueeze(-1), output)
    flags = positions < num_accepted.unsqueeze(-1)  # [B, K]
    return output, num_accepted, flags


def verify_chain_lossless(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                          draft_probs: torch.Tensor | None, uniforms: torch.Tensor,
                          exponentials: Exponentials,
                          num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (Leviathan et al.): the PyTorch twin of the fused Triton kernel."""
    return verify_chain(draft_tokens, target_probs, draft_probs, uniforms, exponentials, num_draft)


def verify_chain_greedy(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                        num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification: accept while x_i == argmax p_i, then emit argmax p at the first mismatch.

    `target_probs` may be logits or probabilities (only the argmax matters). No randomness.
    """
    b, k = draft_tokens.shape
    if k == 0:
        return plain_step_result(target_probs[:, 0].argmax(-1))
    best = target_probs.argmax(-1)  # [B, K+1]
    positions = torch.arange(k, device=draft_tokens.device)
    accepted = (draft_tokens == best[:, :k]) & (positions < num_draft.unsqueeze(-1))  # [B, K]
    num_accepted = count_leading(accepted)  # [B]
    final_token = best.gather(1, num_accepted.unsqueeze(-1))  # [B, 1]
    out_positions = torch.arange(k + 1, device=draft_tokens.device)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((b, 1), -1)], dim=1)
    output = torch.where(out_positions < num_accepted.unsqueeze(-1), padded, torch.full_like(padded, -1))
    output = torch.where(out_positions == num_accepted.unsqueeze(-1), final_token, output)
    return output, num_accepted, positions < num_accepted.unsqueeze(-1)
