"""A step's arithmetic: the loss of a batch, the forward and backward of a step's examples over
its micro-batches (weighted so that the summed gradients equal the whole batch's), evaluation;
and the same for preference pairs (DPO: the reference is the base model, the adapters off)."""

from __future__ import annotations

import logging
import time

import torch
from torch.nn import functional as F

from engine import device as accelerator
from engine.data import IGNORE, Dataset, collate
from engine.lora import adapters_off
from engine.model.common.moe import Router
from kiln_kernels.ahead import compiling_ahead

log = logging.getLogger(__name__)


def batch_loss(
    model: torch.nn.Module, batch: dict, device: torch.device, cp=None
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Mean cross-entropy over target tokens, the target count, and how many were argmax-right (a
    tensor on the device: reading it waits for the forward, so the caller reads it after it has
    launched the backward). ``cp``: the batch is a context-parallel rank's slice
    (engine.parallel.context.split)."""
    n = int((batch["labels_BT"][:, 1:] != IGNORE).sum())  # counted where the batch was made: no wait
    ids = batch["input_ids_BT"].to(device)
    labels = batch["labels_BT"].to(device)
    docs, pos = (batch[k].to(device) if batch[k] is not None else None for k in ("doc_ids_BT", "positions_BT"))
    with accelerator.autocast(device):
        loss, right = model(ids, batch["pixels_NCHW"].to(device), docs, pos, labels_BT=labels, past=cp)  # no logits
    return loss, n, right


def forward_backward(model: torch.nn.Module, batch: dict, device: torch.device, cp, total: int | None):
    """The loss of ``batch`` (as ``batch_loss``) and its backward, weighted by its share of
    ``total`` targets (None: weighted 0)."""
    loss, n, right = batch_loss(model, batch, device, cp)
    indexer_loss = getattr(model, "indexer_loss", None)
    extra = indexer_loss() if indexer_loss is not None and model.training else None
    weight = n / total if total else 0.0
    ((loss + extra if extra is not None else loss) * weight).backward()  # DSA indexers learn by KL
    return loss, n, right


REHEARSAL_SLICE = 16384  # rows longer than twice this are rehearsed on a slice of them (``rehearsal``)


def rehearsal(batch: dict, cp) -> dict:
    """What a first step rehearses of ``batch``: rows of T > 2 x REHEARSAL_SLICE tokens cut to their
    first ``REHEARSAL_SLICE + T % REHEARSAL_SLICE``. The pass's other work (cuBLAS, attention)
    runs for real, in time that grows with the row (at 128k tokens, by the step's split, seconds of
    the first step); the slice names the same kernels with the same specialisations (Triton's: an
    integer's divisibility by 16 and whether it is 1), as the lengths and every count of blocks of
    up to REHEARSAL_SLICE / 16 tokens agree modulo 16. A kernel the slice still misses compiles at
    its launch in the step (tests/gpu/test_rehearse_cuda.py checks a 37k-token row misses none).
    Images (their tokens would be cut from their pixels) and context-parallel slices are
    rehearsed whole."""
    T = batch["input_ids_BT"].shape[1]
    if cp is not None or batch["pixels_NCHW"].numel() or T <= 2 * REHEARSAL_SLICE:
        return batch
    S = REHEARSAL_SLICE + T % REHEARSAL_SLICE
    return {k: v[:, :S] if k.endswith("_BT") and v is not None else v for k, v in batch.items()}


def rehearse(model: torch.nn.Module, batch: dict, device: torch.device, cp) -> bool:
    """Compile the kernels of a forward and backward of ``batch`` (its ``rehearsal``) side by side
    before it runs (kiln_kernels.ahead): the pass launches no Triton kernel, so its numbers are
    garbage, and it leaves no trace: the gradients, the routers' token counts and the random
    generators are as they were (a resumed job draws what it would have drawn). False where there
    is nothing to compile ahead (the CPU)."""
    if not accelerator.accelerated(device):
        return False
    t0 = time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]  # set aside: a backward would add into them in place
    for p in params:
        p.grad = None
    routers = [(m, m.load) for m in model.modules() if isinstance(m, Router)]
    cpu_rng, device_rng = torch.get_rng_state(), accelerator.rng_state()
    try:
        with compiling_ahead() as compiling:
            if compiling:
                forward_backward(model, rehearsal(batch, cp), device, cp, None)
    except Exception as e:  # only time is lost: the step compiles what it still needs as it runs
        log.warning("the first step's kernels were not compiled ahead: %s: %s", type(e).__name__, e)
        compiling = False
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        for m, load in routers:
            m.load = load
        torch.set_rng_state(cpu_rng)
        accelerator.set_rng_state(device_rng)
    if compiling:
        log.info("the first step's kernels compiled ahead in %.1f s", time.perf_counter() - t0)
    return compiling


def accumulate(
    model: torch.nn.Module, samples: list, micro: int, pad: int, pack_to: int | None, ranks, ahead: bool = False
) -> tuple[torch.Tensor, int, torch.Tensor, int, int]:
    """Forward and backward this rank's share of the step's examples in ``micro`` parts, each
    weighted by its share of the target tokens of the whole step (on all ranks): the gradients,
    summed over the ranks, equal the whole batch's (context parallel too: each rank's slice holds
    its own targets). ``ranks``: engine.training.ranks. ``ahead``: the first part is rehearsed
    first, its kernels compiled side by side (``rehearse``; a process's first step). Returns (loss,
    targets, right, tokens, rows) for the step, over all ranks: the loss and the right count as
    tensors on the device (one rank: nothing is read from the device here, so the update is
    queued behind the backward before the host waits for either)."""
    total = sum(s.targets for s in samples) or 1
    loss_sum: torch.Tensor | float = 0.0
    right_sum: torch.Tensor | int = 0
    n_sum, seen, rows = 0, 0, 0
    for part in ranks.share(samples, parts=micro):
        batch, cp, packed = ranks.batch(
            part or samples[:1], pad, pack_to
        )  # a stand-in, weighted 0, keeps the ranks in step
        if ahead:
            rehearse(model, batch, ranks.device, cp)
            ahead = False
        loss, n, right = forward_backward(model, batch, ranks.device, cp, total if part else None)
        if part:
            loss_sum = loss_sum + loss.detach().double() * n
            n_sum, right_sum = n_sum + n, right_sum + right
            seen += int((batch["input_ids_BT"] != pad).sum())  # under context parallel: this slice's
            rows += packed
    loss_sum, n_sum, right_sum, seen, rows = ranks.sum(loss_sum, n_sum, right_sum, seen, rows)
    return torch.as_tensor(loss_sum / max(n_sum, 1)), int(n_sum), torch.as_tensor(right_sum), int(seen), int(rows)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: Dataset, indices: list[int], bs: int, pad: int, pack_to: int | None, ranks
) -> dict:
    """The mean loss and token accuracy over ``indices`` of ``data``, over all ranks."""
    was = model.training
    model.eval()
    total, n, right = 0.0, 0, 0
    for part in ranks.share(indices, size=bs):
        batch, cp, _ = ranks.batch(
            [data[j] for j in part or indices[:1]], pad, pack_to
        )  # a stand-in keeps the ranks in step
        loss, k, r = batch_loss(model, batch, ranks.device, cp)
        if part:
            total, n, right = total + float(loss) * k, n + k, right + int(r)
    total, n, right = ranks.sum(total, n, right)
    model.train(was)
    return {"valid_loss": total / max(n, 1), "valid_mean_token_accuracy": right / max(n, 1)}


def sequence_logp(model: torch.nn.Module, sample, pad: int, device: torch.device) -> torch.Tensor:
    """The log-probability of ``sample``'s target tokens (its answer) under the model: the sum,
    through the same fused loss as training (the mean times the count)."""
    loss, n, _ = batch_loss(model, collate([sample], pad), device)
    return -loss * n


def dpo_terms(
    model: torch.nn.Module, pair, pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(policy chosen, policy rejected, reference chosen, reference rejected) log-probabilities of
    one preference pair; the reference is the base model (the adapters off), without gradients."""
    assert pair.rejected is not None, "DPO takes preference pairs"
    with torch.no_grad(), adapters_off(model):
        ref = [sequence_logp(model, s, pad, device) for s in (pair, pair.rejected)]
    return sequence_logp(model, pair, pad, device), sequence_logp(model, pair.rejected, pad, device), ref[0], ref[1]


def dpo_loss(
    pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta ((pc - rc) - (pr - rr))), and the implicit
    rewards beta (pc - rc) of the preferred and beta (pr - rr) of the rejected answer."""
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    return -F.logsigmoid(chosen - rejected), chosen.detach(), rejected.detach()


def dpo_accumulate(
    model: torch.nn.Module, pairs: list, beta: float, pad: int, device: torch.device, ahead: bool = False
) -> dict:
    """Forward and backward one step's preference pairs, one pair at a time (each weighted 1 / the
    pairs: the gradients sum to the batch mean's); the step's DPO metrics. ``ahead``: the first
    pair's preferred answer is rehearsed first (``rehearse``: the same kernels)."""
    if ahead and pairs:
        rehearse(model, collate([pairs[0]], pad), device, None)
    loss_sum = chosen_sum = rejected_sum = 0.0
    right = seen = 0
    for pair in pairs:
        loss, chosen, rejected = dpo_loss(*dpo_terms(model, pair, pad, device), beta)
        (loss / len(pairs)).backward()
        loss_sum, chosen_sum, rejected_sum = (
            loss_sum + float(loss.detach()),
            chosen_sum + float(chosen),
            rejected_sum + float(rejected),
        )
        right += int(chosen > rejected)
        seen += len(pair) + len(pair.rejected)
    k = max(len(pairs), 1)
    return {
        "train_loss": loss_sum / k,
        "rewards_chosen": chosen_sum / k,
        "rewards_rejected": rejected_sum / k,
        "reward_margin": (chosen_sum - rejected_sum) / k,
        "reward_accuracy": right / k,
        "tokens": seen,
    }


@torch.no_grad()
def dpo_evaluate(model: torch.nn.Module, data: Dataset, indices: list[int], beta: float, pad: int, device) -> dict:
    was = model.training
    model.eval()
    losses, right = [], 0
    for i in indices:
        loss, chosen, rejected = dpo_loss(*dpo_terms(model, data[i], pad, device), beta)
        losses.append(float(loss))
        right += int(chosen > rejected)
    model.train(was)
    return {"valid_loss": sum(losses) / max(len(losses), 1), "valid_reward_accuracy": right / max(len(losses), 1)}
