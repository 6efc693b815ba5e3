"""Mesa running estimates across ranks: one policy for DDP and FSDP2.

Every rank quantizes its own micro-batches, so each rank's ``ActivationQuantizer`` updates
its running estimates (``alpha``/``beta``, an exponential moving average of the batch
statistics) from its own data. The policy (``EstimateSync``):

    After every optimizer step, each quantizer's ``alpha`` and ``beta`` become the mean,
    over the ranks that have initialised it, of the ranks' values; ``initialized`` becomes
    true everywhere if it is true anywhere.

The update ``new = decay * old + (1 - decay) * batch`` is linear, and all ranks start a
step from the same estimates, so the mean over ranks is exactly the running estimate of
the rank-averaged batch statistics: the global batch's estimate, as one process training
on the whole global batch with the per-rank statistics averaged would hold. Within a step
(gradient accumulation) ranks use their own micro-batch statistics, as a single process
would. The cost is one all-reduce of ``2 G + 1`` numbers per quantizer per optimizer step
(all quantizers in one flat float64 tensor, no host sync), instead of DDP's broadcast of
every buffer before every forward (the trainer turns DDP's ``broadcast_buffers`` off).

The stochastic-rounding state ``rng = [key, counter]`` is not averaged: the key comes
from the module's name and the counter advances once per compression, so it is identical
on all ranks that ran the same number of steps; ``buffers_identical`` checks it.
BatchNorm-style ``running_mean``/``running_var`` buffers (none in the ViT families here)
and the learned clipping thresholds (``estimator="learned"``: ``clip_*``, with their Adam
moments) are averaged the same way, so a model that has them stays consistent too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from mesa_train.train import distributed as dist_utils


def _quantizers(model: nn.Module) -> list[nn.Module]:
    from mesa_train.nn.quantizer import ActivationQuantizer

    return [m for m in model.modules() if isinstance(m, ActivationQuantizer)]


def _running_stats(model: nn.Module) -> list[torch.Tensor]:
    """Buffers each rank updates from its own data and the ranks average: BatchNorm-style
    running statistics, and the learned clipping thresholds of ``estimator="learned"`` with
    their Adam moments (they drifted apart per rank, and a resume took rank 0's)."""
    from mesa_train.nn.quantizer import LEARNED_BUFFERS

    out = [b for q in _quantizers(model) for n in LEARNED_BUFFERS
           if isinstance(b := q._buffers.get(n), torch.Tensor) and b.is_floating_point()]
    for m in model.modules():
        for name in ("running_mean", "running_var"):
            buf = getattr(m, name, None)
            if isinstance(buf, torch.Tensor) and buf.is_floating_point():
                out.append(buf)
    return out


class EstimateSync:
    """``sync()`` applies the policy above; a no-op outside a multi-rank process group."""

    def __init__(self, model: nn.Module):
        self.model = model

    @property
    def active(self) -> bool:
        return dist_utils.world_size() > 1

    @torch.no_grad()
    def sync(self) -> None:
        if not self.active:
            return
        quantizers, stats = _quantizers(self.model), _running_stats(self.model)
        if not quantizers and not stats:
            return
        pieces = []
        for q in quantizers:
            w = q.initialized.to(torch.float64).reshape(1)
            pieces += [q.alpha.double() * w, q.beta.double() * w, w]
        pieces += [s.double().reshape(-1) for s in stats]
        flat = torch.cat(pieces)
        dist.all_reduce(flat)  # SUM: gloo has no AVG; the same bits land on every rank
        offset, world = 0, float(dist_utils.world_size())
        for q in quantizers:
            G = q.alpha.numel()
            a, b = flat[offset:offset + G], flat[offset + G:offset + 2 * G]
            n = flat[offset + 2 * G]
            offset += 2 * G + 1
            seen = n > 0  # no rank has initialised it yet: leave it as it is (all zeros)
            q.alpha.copy_(torch.where(seen, a / n.clamp_min(1), q.alpha.double()))
            q.beta.copy_(torch.where(seen, b / n.clamp_min(1), q.beta.double()))
            q.initialized.copy_(seen)
        for s in stats:
            s.copy_((flat[offset:offset + s.numel()] / world).view_as(s))
            offset += s.numel()


def buffers_identical(model: nn.Module, device: torch.device) -> bool:
    """True when every rank holds bit-identical buffers (all of them: Mesa estimates, the
    rounding ``rng`` state, ...). Compares a float64 checksum per buffer, one all_gather."""
    bufs = list(model.buffers())
    if dist_utils.world_size() <= 1 or not bufs:
        return True
    sums = []
    for b in bufs:
        x = b.detach().reshape(-1)
        x = x.view(torch.int32).double() if x.dtype == torch.float32 else x.double()  # exact bits
        weights = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device)
        sums.append(torch.stack([x.sum(), (x * weights).sum()]))
    stats = torch.stack(sums).to(device)
    gathered = [torch.empty_like(stats) for _ in range(dist_utils.world_size())]
    dist.all_gather(gathered, stats)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])
