"""Tiny timm models shared by the patch tests (fast on 2 CPU cores)."""
from __future__ import annotations

import torch
import timm

# name -> (builder kwargs, input shape)
TINY = {
    "deit": (dict(model_name="deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10,
                  drop_rate=0.0, drop_path_rate=0.0),
             (4, 3, 32, 32)),
    # depths (2, 2): block 1 of each stage is shifted (SW-MSA with the mask), stage 1 has
    # patch merging; window 4 on an 8x8 (stage 0) map -> 4 windows per image.
    "swin": (dict(model_name="swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4,
                  depths=(2, 2), num_heads=(2, 4), embed_dim=16, num_classes=10, drop_rate=0.0, drop_path_rate=0.0),
             (2, 3, 32, 32)),
    # 4 stages with spatial reduction 8/4/2/1 on a 64x64 input: 16x16, 8x8, 4x4, 2x2 maps.
    "pvt": (dict(model_name="pvt_v2_b0", depths=(1, 1, 1, 1), embed_dims=(16, 32, 32, 64), num_heads=(1, 2, 2, 4),
                 num_classes=10, drop_rate=0.0, drop_path_rate=0.0),
            (2, 3, 64, 64)),
    # PVT-v2 "linear" variant (b2_li): pooled keys/values (pool + sr 1x1 conv + norm + GELU)
    # and an extra ReLU in the MLP
    "pvt_li": (dict(model_name="pvt_v2_b2_li", depths=(1, 1, 1, 1), embed_dims=(16, 32, 32, 64),
                    num_heads=(1, 2, 2, 4), num_classes=10, drop_rate=0.0, drop_path_rate=0.0),
               (2, 3, 64, 64)),
}


# the op sets the compile and GPU tests patch with
OPSETS = {
    "all": ("all",),  # the paper's explicit attention, every op compressed
    "sdpa": ("linear", "gelu", "layernorm", "conv", "sdpa"),  # fused attention kept fused
}


def build(name: str, fused: bool | None = None, seed: int = 0) -> torch.nn.Module:
    kwargs, _ = TINY[name]
    torch.manual_seed(seed)
    model = timm.create_model(pretrained=False, **kwargs).train()
    if fused is not None:
        set_fused(model, fused)
    return model


def inputs(name: str, seed: int = 1) -> torch.Tensor:
    _, shape = TINY[name]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def set_fused(model, fused: bool) -> None:
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = bool(fused)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient differs per sample and class (``out.sum()`` would send the same
    gradient to every sample)."""
    g = torch.Generator().manual_seed(123)
    w = torch.randn(out.shape, generator=g, dtype=torch.float32)
    return (out.float() * w).sum()


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def step_and_compare(stock, mesa, x, seed: int = 3, min_cosine: float = 0.99, rounding_noise: float = 0.0) -> None:
    """One training step of each model on ``x`` (the same seed: the same dropout and drop-path
    masks): the outputs bitwise equal, every non-zero parameter gradient of ``mesa`` at cosine
    ``> min_cosine`` to ``stock``'s. ``rounding_noise``: gradients whose stock norm is under that
    fraction of the largest one are skipped (zero in exact arithmetic, such as a BatchNorm bias
    before a conv and another BatchNorm: float rounding in stock, 8-bit noise in Mesa)."""
    import torch.nn.functional as F

    outs, all_grads = [], []
    for model in (stock, mesa):
        torch.manual_seed(seed)
        out = model(x)
        loss_of(out).backward()
        outs.append(out)
        all_grads.append(grads(model))
    assert torch.equal(outs[0], outs[1])
    floor = rounding_noise * max(float(g.norm()) for g in all_grads[0].values())
    for n, g in all_grads[0].items():
        if g.norm() > floor:
            cos = float(F.cosine_similarity(all_grads[1][n].flatten().double(), g.flatten().double(), dim=0))
            assert cos > min_cosine, (n, cos)
