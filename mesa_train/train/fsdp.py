"""FSDP2 (``torch.distributed.fsdp.fully_shard``) wiring for the timm vision transformers.

Each transformer block is its own FSDP unit (its parameters are all-gathered just before
its forward/backward and resharded after), and the root module holds the rest (patch
embedding, position embeddings, norm, head). Blocks are found as the children of every
``blocks`` container (``nn.Sequential``/``nn.ModuleList``): ``model.blocks`` in DeiT/ViT,
``layers[i].blocks`` in Swin, ``stages[i].blocks`` in PVT v2.

Mixed precision follows ``trainer.amp``: parameters are all-gathered in bf16/fp16 and
gradients reduced in fp32 (the sharded master weights and optimizer state stay fp32).
Buffers are not sharded: the Mesa running estimates stay whole, fp32, on every rank, and
``mesa_train.train.estimates.EstimateSync`` keeps them identical across ranks.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from mesa_train.compile_scope import repeated_blocks


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks to shard one by one, in forward order: the same blocks that
    ``trainer.compile_scope=blocks`` compiles (one rule for both, so each compiled block is
    exactly one FSDP unit)."""
    return [block for _, block in repeated_blocks(model)]


def apply_fsdp(model: nn.Module, *, mesh=None, param_dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True, cpu_offload: bool = False) -> nn.Module:
    """Shard ``model`` in place (per block, then the root) and return it.

    ``reshard_after_forward=False`` keeps each block's gathered parameters from forward to
    backward (less communication, more memory; ZeRO-2-like). ``cpu_offload`` keeps the
    sharded parameters, gradients and optimizer state in host memory (CUDA only)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        # The last block's backward starts right after the forward ends: resharding it
        # would only be gathered again at once.
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    return model


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (a collective), the tensor itself otherwise."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def local_bytes(tensors) -> int:
    """Bytes this rank holds for ``tensors`` (shards of DTensors)."""
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors if t is not None)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]
