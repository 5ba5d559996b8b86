"""Several processes of one mmspec command (`accelerate launch` or `torchrun`): the process state, and what
data-parallel work takes from it. Every function is the identity of a single process (`state` None).

    state = process_state(cpu=True)                 # None unless launched with WORLD_SIZE > 1 (gloo on CPU)
    mine = shard(range(n), state)                   # this process's items: r, r + P, r + 2P, ...
    every = gather_shards(results_of_mine, state)   # all items, in the single-process order
    loss, logged = weigh_share(loss, logged, positions, state)   # this share's part of the batch's mean
    average_gradients(model.parameters(), state)    # after backward: every process holds the mean gradient
    end_processes()                                 # the command line's last step: leave the group cleanly

Invariant: data-parallel training keeps every process's model, optimiser and generator identical, so any process may
write the checkpoint (the first one does) and a resumed run restores the same state in each.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch


def process_state(cpu: bool):
    """accelerate's PartialState when launched with several processes (accelerate launch / torchrun), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    return PartialState(cpu=cpu)


def rank_and_count(state) -> tuple[int, int]:
    """(this process's index, the number of processes): (0, 1) in a single process."""
    return (0, 1) if state is None else (state.process_index, state.num_processes)


def shard(items: Sequence, state) -> list:
    """This process's share of `items`: every num_processes-th one from its index."""
    rank, count = rank_and_count(state)
    return list(items[rank::count])


def gather_shards(mine: list, state) -> list:
    """Every process's `shard` results back in the single-process order (picklable items)."""
    if state is None:
        return list(mine)
    _, count = rank_and_count(state)
    parts: list = [None] * count
    torch.distributed.all_gather_object(parts, mine)
    return [parts[i % count][i // count] for i in range(sum(len(p) for p in parts))]


def sum_over_processes(values: torch.Tensor, state) -> torch.Tensor:
    """values summed over the processes (float64 on this process's device; the same tensor in a single one)."""
    if state is None:
        return values
    total = values.detach().to(torch.float64).to(state.device)
    torch.distributed.all_reduce(total)
    return total


def weigh_share(loss: torch.Tensor, logged: tuple[torch.Tensor, ...], weight: torch.Tensor,
                state) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A process's mean loss over its share of a batch, scaled by the share's weight (its positions or rows) times
    the process count over the batch's whole weight: the gradients `average_gradients` then averages are the whole
    batch's mean. The logged figures (detached means) become the batch's weighted means."""
    if state is None:
        return loss, logged
    total = sum_over_processes(weight, state)
    loss = loss * (weight.to(total) * state.num_processes / total).to(loss.device, loss.dtype)
    logged = tuple((sum_over_processes(torch.stack([x.double() for x in logged]) * weight.double().to(total.device),
                                       state) / total).unbind())
    return loss, logged


def average_gradients(parameters: Iterable[torch.nn.Parameter], state) -> None:
    """Replace each parameter's gradient by its mean over the processes (one flat all-reduce)."""
    if state is None:
        return
    params = list(parameters)
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=state.device)
    torch.distributed.all_reduce(has_grad, op=torch.distributed.ReduceOp.MAX)  # a gradient in any process
    grads = []
    for p, present in zip(params, has_grad.tolist()):
        if present and p.grad is None:
            p.grad = torch.zeros_like(p)
        if present:
            grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat)
    flat /= state.num_processes
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def end_processes() -> None:
    """Leave the process group, if this process joined one (no barrier: a process whose share of a job was done
    before, on a resume, must not wait out the group's timeout for the others). A gloo group left to the
    interpreter's exit can abort a process while its threads are torn down (SIGABRT, "terminate called without an
    active exception"), failing a run whose work had finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def wait_for_everyone(state) -> None:
    """A barrier (nothing in a single process)."""
    if state is not None:
        state.wait_for_everyone()
