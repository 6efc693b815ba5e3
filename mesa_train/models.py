"""Short model names used by the configs and benchmarks, mapped onto timm architectures
(any other timm model name is accepted as it is).

timm has no PVT v1; the paper's PVT-Ti is approximated by ``pvt_v2_b1``, which has the
same size (about 13-14M parameters).
"""
from __future__ import annotations

import re

import torch.nn as nn

# short name -> timm model name
MODEL_NAMES = {
    "deit_ti": "deit_tiny_patch16_224",
    "deit_s": "deit_small_patch16_224",
    "deit_b": "deit_base_patch16_224",
    "swin_ti": "swin_tiny_patch4_window7_224",
    "swin_s": "swin_small_patch4_window7_224",
    "swin_b": "swin_base_patch4_window7_224",
    "swin_l": "swin_large_patch4_window7_224",
    "pvt_v2_b0": "pvt_v2_b0",
    "pvt_v2_b1": "pvt_v2_b1",
    "pvt_v2_b2": "pvt_v2_b2",
}


def is_known_model(name: str) -> bool:
    """A short name of ``MODEL_NAMES`` or any model timm can create."""
    import timm

    return name in MODEL_NAMES or timm.is_model(name)


def timm_name(name: str) -> str:
    """Resolve a short name (``deit_ti``) to its timm name; any other timm name is kept."""
    if name in MODEL_NAMES:
        return MODEL_NAMES[name]
    if is_known_model(name):
        return name
    raise ValueError(
        f"unknown model {name!r}; valid choices: {', '.join(MODEL_NAMES)} or any timm model name "
        "(timm.list_models())"
    )


def rejected_argument(err: BaseException) -> str | None:
    """The keyword argument a constructor's ``TypeError`` says it does not take (None if another error)."""
    # (Python's "got an unexpected keyword argument 'x'"; timm's MetaFormer: "got unexpected keyword
    # argument(s): ['x']")
    found = re.search(r"unexpected keyword argument(?:\(s\): \[)? ?'(\w+)'", str(err))
    return found.group(1) if found else None


def build_model(name: str, *, fused_attn: bool | None = None, img_size_optional: bool = False,
                **overrides) -> nn.Module:
    """``timm.create_model`` with our short names. ``overrides`` (``num_classes``,
    ``img_size``, ``depth``, ``embed_dim``, ``num_heads``, ``drop_path_rate``, ...) are passed
    to timm when not None. ``fused_attn`` forces timm's fused (sdpa) or explicit attention.
    ``img_size_optional``: a model whose constructor takes no ``img_size`` (a CNN; PVT-v2,
    which takes any size) is built without it; set it where the image size comes from a
    general setting (``model.img_size``, a bench row's size), not from the user naming the
    argument for this model."""
    import timm

    kwargs = {k: v for k, v in overrides.items() if v is not None}
    kwargs.setdefault("pretrained", False)  # no network here; weights come from checkpoints
    try:
        model = timm.create_model(timm_name(name), **kwargs)
    except TypeError as err:  # an override the architecture does not take
        bad = rejected_argument(err)
        if bad == "img_size" and img_size_optional:
            return build_model(name, fused_attn=fused_attn, **{k: v for k, v in overrides.items() if k != bad})
        if bad is not None:  # (name it, not every override: the rest were never looked at)
            raise ValueError(f"model {name!r} ({timm_name(name)}) takes no argument {bad!r}: {err}") from err
        raise ValueError(f"model {name!r} cannot take overrides {sorted(kwargs)}: {err}") from err
    if fused_attn is not None:
        set_fused_attention(model, fused_attn)
    return model


def set_fused_attention(model: nn.Module, enabled: bool) -> int:
    """Switch every timm attention module between fused sdpa and the explicit
    ``softmax(q @ k^T) @ v`` path. Returns how many modules were switched."""
    count = 0
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = bool(enabled)
            count += 1
    return count


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model inside DistributedDataParallel / DataParallel / torch.compile
    wrappers, in any nesting order."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model


def unwrap_module(model, caller: str) -> nn.Module:
    """``unwrap_model(model)`` for the library's public functions: a ``TypeError`` naming
    ``caller`` when ``model`` is no ``nn.Module`` (``None``, a state dict, a class), not an
    ``AttributeError`` from deep inside."""
    if not isinstance(model, nn.Module):
        kind = f"the class {model.__name__} (build it first)" if isinstance(model, type) else type(model).__name__
        raise TypeError(f"{caller}: model must be a torch.nn.Module (a timm model, or a DDP / torch.compile "
                        f"wrapper of one), got {kind}")
    return unwrap_model(model)
