"""Build the model a config describes: timm architecture, optional local weights, then Mesa.

``model.name`` is a short name of mesa_train.models or any timm model. ``model.pretrained_path``
fine-tunes from a local file: a timm/PyTorch weights file (``.pth``/``.bin``/``.safetensors``,
nested ``state_dict``/``model`` entries and ``module.`` prefixes are understood) or a
mesa-train checkpoint (its model weights, Mesa estimates dropped: they restart). The
weights go into the stock model through the architecture's own timm filter (position
embeddings resized to ``model.img_size``, original-format keys converted); the classifier
is re-initialised when its shape differs (another class count). Mesa patches afterwards.
"""
from __future__ import annotations

import logging
import re
import sys
import warnings

import torch
import torch.nn as nn
from timm.layers import PatchEmbed

from mesa_train.models import build_model, rejected_argument, timm_name
from mesa_train.train.config import ConfigError, head_counts, mesa_options, named_model_kwargs

log = logging.getLogger("mesa_train.train")


def _overrides(cfg, num_classes: int, drop_path: float | None) -> dict:
    overrides = dict(cfg.model.kwargs or {})
    named = {key: value for key, (_, value) in named_model_kwargs(cfg).items()}
    named["drop_path_rate"] = drop_path  # the caller's (optim.drop_path; evaluation builds without)
    overrides.update({k: v for k, v in named.items() if v is not None}, num_classes=num_classes)
    # OmegaConf lists -> tuples (timm compares/iterates them).
    return {k: tuple(v) if isinstance(v, (list,)) or type(v).__name__ == "ListConfig" else v
            for k, v in overrides.items()}


def _create(cfg, num_classes: int, drop_path: float | None) -> nn.Module:
    """``build_model`` with the ``model`` group's overrides. ``model.img_size`` (passed by
    ``model.img_size_kwarg``, true by default) is optional for the constructor: a CNN or PVT-v2
    is built without it and the images are still that size, as the transforms make them
    (``model.name=resnet18 model.img_size=32`` trains). ``+model.kwargs.img_size`` is not."""
    return build_model(cfg.model.name, fused_attn=cfg.model.fused_attn,
                       img_size_optional="img_size" not in (cfg.model.kwargs or {}),
                       **_overrides(cfg, num_classes, drop_path))


# what to set instead, where a named setting passes an argument the model does not take: the
# hierarchical models of configs/model (timm name prefix -> argument -> advice)
_PER_STAGE = {
    "swin": {"depth": "; Swin takes one depth per stage: '+model.kwargs.depths=[2,2,6,2]'",
             "num_heads": "; Swin takes one head count per stage: '+model.kwargs.num_heads=[3,6,12,24]'"},
    "pvt_v2": {"depth": "; PVT-v2 takes one depth per stage: '+model.kwargs.depths=[2,2,2,2]'",
               "embed_dim": "; PVT-v2 takes one width per stage: '+model.kwargs.embed_dims=[64,128,320,512]'",
               "num_heads": "; PVT-v2 takes one head count per stage: '+model.kwargs.num_heads=[1,2,5,8]'"},
}


def _per_stage_advice(name: str, argument: str) -> str:
    family = next((f for f in _PER_STAGE if timm_name(name).startswith(f)), None)
    return _PER_STAGE.get(family, {}).get(argument, "")


def check_buildable(cfg, num_classes: int = 10) -> None:
    """Build the architecture on the meta device (no memory, no data needed): a value timm
    cannot take fails at start-up as a ``ConfigError``, not after the data is loaded; then the
    patch grid, the image size (one meta forward) and a ``model.fused_attn`` with no effect."""
    try:
        with torch.device("meta"):
            model = _create(cfg, num_classes, cfg.optim.drop_path)
    except Exception as err:  # timm raises assertion/type/value errors for bad shapes
        raise _build_error(cfg, num_classes, err) from None
    check_patch_grid(model)
    check_image_size(cfg, model, num_classes)
    if cfg.model.fused_attn is not None and not any(hasattr(m, "fused_attn") for m in model.modules()):
        # (a setting that changes nothing is said, not silently ignored)
        log.warning("model.fused_attn=%s changes nothing: %s has no timm attention module with a fused (sdpa) "
                    "switch", cfg.model.fused_attn, cfg.model.name)


# Python's words for one number given where a list is indexed or iterated
_ONE_FOR_A_LIST = re.compile(r"'int' object is not (subscriptable|iterable)|object of type 'int' has no len")


def _build_error(cfg, num_classes: int, err: Exception) -> ConfigError:
    """The one line for a model timm cannot build with these settings, naming the setting to
    change where it can be told: an argument the model takes not, one number where the family
    takes one per stage, a head count that does not divide the width; else timm's words."""
    name = cfg.model.name
    bad = rejected_argument(err.__cause__) if isinstance(err, ValueError) else None
    owner = named_model_kwargs(cfg).get(bad, (None,))[0] if bad else None
    if owner is not None:  # (model.depth on a Swin: name the setting, not every override)
        return ConfigError(f"model {name!r} ({timm_name(name)}) takes no argument {bad!r}, which {owner} passes: "
                           f"set {owner}=null{_per_stage_advice(name, bad)}")
    if bad is not None and bad in (cfg.model.kwargs or {}):
        return ConfigError(f"model {name!r} ({timm_name(name)}) takes no argument {bad!r}: remove model.kwargs.{bad}")
    cause = err.__cause__ or err  # (timm's own words, not build_model's list of every override)
    staged = [(owner, value, _per_stage_advice(name, arg)) for arg, (owner, value) in named_model_kwargs(cfg).items()
              if isinstance(value, int) and _per_stage_advice(name, arg)
              and (arg in str(cause) or _ONE_FOR_A_LIST.search(str(cause)))]
    if staged:  # (one number where the family takes a list: Swin's model.num_heads=5, "'int' object is not
        # subscriptable"; PVT-v2's "dim 32 should be divided by num_heads 5")
        owner, value, advice = staged[0]
        return ConfigError(f"model {name!r} cannot be built with {owner}={value} ({type(cause).__name__}: "
                           f"{str(cause).strip()}): set {owner}=null{advice}")
    heads = _head_count_advice(cfg, num_classes, err)
    if heads:
        return ConfigError(heads)
    return ConfigError(f"model {name!r} cannot be built with these model.* settings: "
                       f"{type(err).__name__}: {str(err).strip() or 'invalid shape'}")


def check_image_size(cfg, meta_model: nn.Module, num_classes: int) -> None:
    """``ConfigError`` where the model cannot run on the images the data gives (RGB,
    ``model.img_size`` square): a Swin window, a LeViT or CrossViT grid, a model built without
    ``img_size`` that only runs at its own size, ``in_chans=1``. Found by one forward on the meta
    device (no memory, no time); a failure there is confirmed by a real forward of one image
    (a model doing data-dependent work cannot run on meta), so the check never refuses a model
    that runs. Before, the start-up measurement's forward failed with a traceback."""
    size = int(cfg.model.img_size)
    if _runs_on_meta(meta_model, (size, size)):
        return
    try:  # (confirmed on a real image)
        with torch.no_grad():
            _create(cfg, num_classes, None).eval()(torch.zeros(1, 3, size, size))
    except Exception as err:  # noqa: BLE001 - timm asserts, shape and channel errors
        text = " ".join(str(err).split()) or "no message"
        advice = _image_size_advice(cfg, meta_model, num_classes, size)
        raise ConfigError(f"model {cfg.model.name!r} cannot run on 3x{size}x{size} images "
                          f"(model.img_size={size}): {type(err).__name__}: {text[:300]}{advice}") from None


def _image_size_advice(cfg, meta_model: nn.Module, num_classes: int, size: int) -> str:
    """What would run: the model built for ``model.img_size`` where ``model.img_size_kwarg=false``
    kept the argument from it, or its pretrained size where its constructor takes none (then
    ``model.img_size`` was dropped for it)."""
    if "img_size" in (cfg.model.kwargs or {}):
        return ""
    try:  # (one build tells both: whether the constructor takes img_size, and whether that runs)
        with torch.device("meta"):
            sized = build_model(cfg.model.name, num_classes=num_classes, img_size=size)
    except Exception:  # noqa: BLE001 - it takes none (or cannot be built so)
        sized = None
    if not cfg.model.get("img_size_kwarg"):
        runs = sized is not None and _runs_on_meta(sized, (size, size))
        return "; set model.img_size_kwarg=true to build it for this size" if runs else ""
    if sized is not None:
        return ""
    try:
        import timm

        own = tuple(timm.get_pretrained_cfg(timm_name(cfg.model.name)).input_size[1:])
    except Exception:  # noqa: BLE001 - no pretrained config: no advice
        return ""
    if own == (size, size) or not _runs_on_meta(meta_model, own):
        return ""
    return (f"; it takes no img_size argument, and it runs at its pretrained size: model.img_size={own[0]}"
            if own[0] == own[1] else f"; it takes no img_size argument, and it runs at its pretrained size "
                                     f"{own[0]}x{own[1]}")


def _runs_on_meta(meta_model: nn.Module, size: tuple) -> bool:
    try:
        with torch.device("meta"), torch.no_grad():
            meta_model.eval()(torch.empty(1, 3, *size))
        return True
    except Exception:  # noqa: BLE001 - any failure: the caller confirms or gives no advice
        return False


def _head_count_advice(cfg, num_classes: int, err: Exception) -> str:
    """timm's "dim should be divisible by num_heads" for ``model.num_heads``, as the valid
    choices: the divisors of the width (``model.embed_dim``, or the model's own where that is
    not set). Empty where the error is another, or the width cannot be read."""
    heads = cfg.model.num_heads
    if "divisible by num_heads" not in str(err) or not isinstance(heads, int):
        return ""
    width = cfg.model.embed_dim if cfg.model.embed_dim is not None else (cfg.model.kwargs or {}).get("embed_dim")
    if width is None:
        try:
            with torch.device("meta"):
                width = getattr(build_model(cfg.model.name, num_classes=num_classes), "embed_dim", None)
        except Exception:  # noqa: BLE001 - no advice then; the caller's message stands
            return ""
    if not isinstance(width, int) or width <= 0 or width % heads == 0:  # (then another width failed: timm's words)
        return ""
    whose = ("model.embed_dim" if cfg.model.embed_dim is not None
             else "model.kwargs.embed_dim" if "embed_dim" in (cfg.model.kwargs or {}) else "the model")
    return (f"model.num_heads={heads} does not divide the width {width} ({whose}'s): valid head counts: "
            f"{head_counts(width)}")


def check_patch_grid(model: nn.Module) -> None:
    """``ConfigError`` where timm's patch embedding would drop pixels: its convolution has
    stride = kernel = patch size and no padding, so an image side that is not a multiple of the
    patch size loses its last pixels without a word (model.img_size=30, patch 8: 24 used). A
    model that pads (``dynamic_img_pad``) or embeds with overlapping convolutions (PVT-v2) is fine."""
    embed = getattr(model, "patch_embed", None)
    if not isinstance(embed, PatchEmbed) or embed.img_size is None or embed.dynamic_img_pad:
        return
    for side, patch in zip(embed.img_size, embed.patch_size):
        if side % patch:
            lower, upper = side - side % patch, side - side % patch + patch
            valid = f"{lower} or {upper}" if lower else f"{upper}"
            raise ConfigError(f"model.img_size={side} is not a multiple of the patch size {patch}: the patch "
                              f"embedding would drop the last {side % patch} pixels of each image side; "
                              f"use model.img_size={valid}")


def build(cfg, num_classes: int, drop_path: float | None = None, pretrained: bool = True) -> nn.Module:
    """``mesa_train.build_model`` with the ``model`` group's overrides, local weights from
    ``model.pretrained_path`` when set (and ``pretrained``: a resumed run takes its weights
    from the checkpoint), then ``mesa_train.patch_model`` when ``mesa.enabled`` (and no
    ``mesa.plan``: the runner applies a plan after moving the stock model to its device)."""
    m = cfg.model
    model = _create(cfg, num_classes, drop_path)
    if pretrained and m.get("pretrained_path"):
        load_pretrained(model, str(m.pretrained_path))
    # A plan (mesa.plan) patches later, on the device: planning profiles the stock model there.
    if cfg.mesa.enabled and cfg.mesa.get("plan") is None:
        from mesa_train import patch_model

        with warnings.catch_warnings():
            if cfg.mesa.get("duplicates", "skip") == "skip":
                # patch_model's word on attentions moved to the explicit path: training measures
                # it at start-up and puts them back where that keeps less (runner._skip_duplicates)
                warnings.filterwarnings("ignore", message=r"mesa_train\.patch_model: \d+ attentions? built fused")
            model = patch_model(model, **mesa_options(cfg))
    return model


# ---------------------------------------------------------------- local pretrained weights


def read_weights(path: str) -> dict:
    """The model weights in ``path`` (timm/PyTorch file or mesa-train checkpoint), without
    Mesa estimate buffers and wrapper prefixes."""
    from mesa_train.patch import patched_to_stock_state_dict
    from mesa_train.train.checkpoint import FORMAT, CheckpointError, load_failure

    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(path, device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"model.pretrained_path={path}: cannot read weights ({load_failure(err)})") from None
    if isinstance(state, dict) and state.get("format") == FORMAT:
        state = state["model"]
    else:
        for key in ("state_dict", "model", "module", "model_ema", "state_dict_ema"):
            if isinstance(state, dict) and isinstance(state.get(key), dict):
                state = state[key]
                break
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise CheckpointError(f"model.pretrained_path={path}: no state dict of tensors found")
    state = {_strip_prefix(k): v for k, v in state.items()}
    return dict(patched_to_stock_state_dict(state))


def _strip_prefix(key: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        while key.startswith(prefix):
            key = key[len(prefix):]
    return key


def _classifier_keys(model: nn.Module) -> list[str]:
    names = (getattr(model, "pretrained_cfg", None) or {}).get("classifier") or "head"
    names = [names] if isinstance(names, str) else list(names)
    return [k for k in model.state_dict() if any(k == n or k.startswith(n + ".") for n in names)]


def load_pretrained(model: nn.Module, path: str) -> None:
    """Load ``path`` into the (stock, unpatched) ``model`` as described in the module docstring."""
    from mesa_train.train.checkpoint import CheckpointError, check_finite_weights

    state = read_weights(path)
    filter_fn = getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)
    if filter_fn is not None:
        try:
            state = filter_fn(state, model)
        except Exception as err:  # a file of another architecture
            raise CheckpointError(f"model.pretrained_path={path} does not fit {type(model).__name__}: "
                                  f"{type(err).__name__}: {err}") from None
    own = model.state_dict()
    head = set(_classifier_keys(model))
    reinit = sorted(k for k in head if k in state and tuple(state[k].shape) != tuple(own[k].shape))
    for k in reinit:
        del state[k]
    missing = [k for k in own if k not in state and k not in head]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k}: file {tuple(state[k].shape)}, model {tuple(own[k].shape)}"
              for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        def head_of(items):
            return ", ".join(items[:5]) + (f" (+{len(items) - 5} more)" if len(items) > 5 else "")

        parts = [f"{what}: {head_of(items)}" for what, items in
                 (("missing", missing), ("unexpected", unexpected), ("shape mismatches", shapes)) if items]
        raise CheckpointError(f"model.pretrained_path={path} does not fit model {type(model).__name__} "
                              f"({'; '.join(parts)})")
    check_finite_weights(state, [k for k, _ in model.named_parameters()], f"model.pretrained_path={path}")
    model.load_state_dict(state, strict=False)
    if reinit:
        log.info("pretrained weights from %s; classifier re-initialised (%s: other class count)",
                 path, ", ".join(reinit))
    else:
        log.info("pretrained weights from %s (all %d tensors)", path, len(state))


def describe(model: nn.Module) -> str:
    """``mesa_train.describe`` (the Mesa layout table)."""
    from mesa_train import describe as _describe

    return _describe(model)
