"""Move checkpoints between stock and Mesa-patched models.

A patched model's ``state_dict`` is the stock one (same keys, same tensors: weights are the
same ``Parameter`` objects) plus the Mesa state of every ``ActivationQuantizer``, e.g.
``blocks.0.attn.qkv.quantizer.alpha`` or ``blocks.0.attn.qk_matmul.quantizer_a.beta``: the
buffers ``alpha``, ``beta``, ``initialized`` and the rounding ``rng``; with
``estimator="learned"`` the thresholds ``clip_*``; and for a format other than the paper's
8-bit one (``bits``, ``scale``, ``layout``) the record ``format`` its loader checks.

* :func:`stock_to_patched_state_dict` completes a stock checkpoint with *fresh* estimates
  (``initialized = False``), so a patched model loads it strictly and the estimates start
  from the first training batch. :func:`load_stock_checkpoint` does both steps, and so does a
  patched model's own ``load_state_dict`` (``patch_model`` gives its root the pre-hook
  :func:`accept_stock_checkpoints`) when the checkpoint has no Mesa entry at all and more than
  half of the model's other entries: timm's ``load_checkpoint`` and a user's
  ``model.load_state_dict(stock_sd)`` work on a patched model, and so does a load started at a
  part of it (``patched.backbone.load_state_dict(stock_backbone_sd)``, session 82).
  A checkpoint with some Mesa entries is a patched one and is loaded as given (strictly, a
  missing estimate is an error there).
* :func:`patched_to_stock_state_dict` drops the Mesa buffers, so a stock model loads it
  strictly. :func:`load_patched_checkpoint` does both steps.
* :func:`upgrade_state_dict` renames the Mesa keys a module's earlier patch wrote where a
  later version moved them (a module class's ``mesa_key_upgrades``, ``{old child prefix: new
  prefix or None}``: ConViT's GPSA, whose generic routing's patch softmax became its gated
  layer); :func:`is_mesa_key` tells a quantizer's entry by its name.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Mapping, Optional, Set

import torch
from torch import nn

from mesa_train.models import unwrap_module
from mesa_train.nn.quantizer import FORMAT_KEY, LEARNED_BUFFERS, STATE_BUFFERS, ActivationQuantizer
from mesa_train.warning_site import outside_stacklevel

__all__ = [
    "is_mesa_key",
    "mesa_state_keys",
    "rename_mesa_keys",
    "upgrade_state_dict",
    "stock_to_patched_state_dict",
    "patched_to_stock_state_dict",
    "load_stock_checkpoint",
    "load_patched_checkpoint",
    "accept_stock_checkpoints",
    "declare_key_upgrades",
]

# every entry a quantizer can write into a state dict (the format record is no buffer)
_QUANTIZER_KEYS = (*STATE_BUFFERS, *LEARNED_BUFFERS, FORMAT_KEY)


def _strip(key: str) -> str:
    # DDP ("module.") and torch.compile ("_orig_mod.") prefixes
    for p in ("module.", "_orig_mod."):
        while key.startswith(p):
            key = key[len(p):]
    return key


def mesa_state_keys(model: nn.Module) -> Set[str]:
    """The ``state_dict`` keys of ``model`` (unwrapped) that belong to Mesa quantizers."""
    from mesa_train.nn.quantizer import ActivationQuantizer

    root = unwrap_module(model, "mesa_state_keys")
    keys = set()
    # every name a module is registered under: state_dict() lists a shared module's buffers
    # once per name (CoaT shares one ConvPosEnc between blocks), named_modules() only once
    for name, m in root.named_modules(remove_duplicate=False):
        if isinstance(m, ActivationQuantizer):
            # (its own state_dict: the format record is written by _save_to_state_dict)
            keys.update(f"{name}.{k}" if name else k for k in m.state_dict(keep_vars=True))
    return keys


def is_mesa_key(key: str) -> bool:
    """Whether ``key`` names a quantizer's entry (``<...quantizer...>.<alpha|beta|...>``)."""
    parts = key.split(".")
    return len(parts) >= 2 and parts[-1] in _QUANTIZER_KEYS and "quantizer" in parts[-2]


def rename_mesa_keys(state_dict, prefix: str, upgrades: Mapping[str, Optional[str]]) -> None:
    """In place: the keys under ``prefix + old`` moved to ``prefix + new`` (dropped where ``new``
    is None), for each ``old: new`` of ``upgrades``; a key already at the new name wins."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        for old, new in upgrades.items():
            if key.startswith(prefix + old):
                value = state_dict.pop(key)
                if new is not None:
                    state_dict.setdefault(prefix + new + key[len(prefix + old):], value)
                break


def _apply_key_upgrades(module: nn.Module, state_dict, prefix: str, *rest) -> None:
    """The load pre-hook :func:`declare_key_upgrades` registers: the old keys renamed or dropped."""
    rename_mesa_keys(state_dict, prefix, module.mesa_key_upgrades)


def declare_key_upgrades(module: nn.Module, upgrades: Mapping[str, Optional[str]]) -> None:
    """Give one module instance (a stock class: no class attribute to set) ``mesa_key_upgrades``:
    its plain ``load_state_dict`` and :func:`upgrade_state_dict` rename or drop the Mesa keys an
    earlier patch wrote there (GlobalContext's softmax child, before session 82)."""
    object.__setattr__(module, "mesa_key_upgrades", dict(upgrades))
    hooks = module._load_state_dict_pre_hooks
    if not any(getattr(h, "hook", None) is _apply_key_upgrades for h in hooks.values()):
        module.register_load_state_dict_pre_hook(_apply_key_upgrades)


def upgrade_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> "OrderedDict[str, torch.Tensor]":
    """A copy of ``state_dict`` with the Mesa keys of earlier patches renamed as ``model``'s
    modules declare (``mesa_key_upgrades``: module doc); keys are ``model``'s (unwrapped)."""
    root = unwrap_module(model, "upgrade_state_dict")
    out = OrderedDict(state_dict)
    for name, m in root.named_modules():
        upgrades = getattr(m, "mesa_key_upgrades", None)  # (the class's, or one declare_key_upgrades set)
        if upgrades:
            rename_mesa_keys(out, f"{name}." if name else "", upgrades)
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]
    return out


def patched_to_stock_state_dict(state_dict: Mapping[str, torch.Tensor],
                                model: Optional[nn.Module] = None) -> "OrderedDict[str, torch.Tensor]":
    """A copy of ``state_dict`` without the Mesa state (estimates, learned thresholds, format
    records).

    With ``model`` (the patched model the checkpoint came from, or any model patched the
    same way), exactly its quantizer keys are dropped; without it, keys ending in
    ``<...quantizer...>.<entry>`` for every entry a quantizer writes (``alpha``, ``beta``,
    ``initialized``, ``rng``, ``clip_*``, ``format``) are. DDP/``torch.compile`` key prefixes
    are kept as they are."""
    drop = mesa_state_keys(model) if model is not None else None
    if model is not None:
        state_dict = upgrade_state_dict(model, state_dict)
    out = OrderedDict()
    for k, v in state_dict.items():
        bare = _strip(k)
        if (bare in drop) if drop is not None else is_mesa_key(bare):
            continue
        out[k] = v
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]
    return out


def stock_to_patched_state_dict(state_dict: Mapping[str, torch.Tensor],
                                model: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """``state_dict`` (stock) completed with fresh Mesa estimates for ``model`` (patched):
    ``alpha = beta = 0`` and ``initialized = False`` for every quantizer (learned thresholds
    zero too), so the estimates start from the first training batch; the format records are
    ``model``'s own. Mesa keys already in ``state_dict`` are kept."""
    root = unwrap_module(model, "stock_to_patched_state_dict")
    out = OrderedDict(state_dict)
    for k, v in _fresh_mesa_entries(root, exclude=out).items():
        out[k] = v
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]
    return out


def _fresh_mesa_entries(root: nn.Module, exclude=(), own=None, keys=None) -> "OrderedDict[str, torch.Tensor]":
    """Every Mesa key of ``root`` not in ``exclude``, with the value of a quantizer that has
    seen no batch: zeros (alpha/beta 0, initialized False, learned thresholds 0), and the
    format record the model was patched with. (``own``, ``keys``: ``root``'s state dict and
    Mesa keys where the caller has them.)"""
    own = root.state_dict() if own is None else own
    keys = mesa_state_keys(root) if keys is None else keys
    return OrderedDict((k, own[k].clone() if k.rsplit(".", 1)[-1] == FORMAT_KEY else torch.zeros_like(own[k]))
                       for k in sorted(keys) if k not in exclude)


def _complete_stock_checkpoint(module: nn.Module, state_dict, prefix: str, local_metadata, strict: bool,
                               missing_keys, unexpected_keys, error_msgs) -> None:
    """``load_state_dict`` pre-hook of a patched model (:func:`accept_stock_checkpoints`): a
    stock model's checkpoint gets fresh estimates, in the dict torch is loading from (its own
    copy; the children load from it after this hook). Stock: no Mesa entry under ``prefix``,
    and more than half of the model's other entries (new weights call for new estimates; a
    partial load, a head alone, leaves the estimates as they are and torch lists them missing,
    as it does every key a ``strict=False`` load lacks). ``strict`` is always True here: torch
    does not pass the caller's on to the hooks."""
    if any(k.startswith(prefix) and is_mesa_key(k[len(prefix):]) for k in state_dict):
        return  # a patched checkpoint (maybe under an earlier patch's names): loaded as given
    own, keys = module.state_dict(), mesa_state_keys(module)
    others = [k for k in own if k not in keys]
    if not keys or 2 * sum(prefix + k in state_dict for k in others) <= len(others):
        return
    fresh = _fresh_mesa_entries(module, own=own, keys=keys)
    for k, v in fresh.items():
        state_dict[prefix + k] = v
    layers = sorted({k.rsplit(".", 1)[0] for k in fresh})
    warnings.warn(f"load_state_dict: a checkpoint without Mesa estimates (a stock model's) in "
                  f"{type(module).__name__}: its {len(layers)} Mesa quantizers start their estimates from the "
                  f"next batch (as mesa_train.patch.load_stock_checkpoint does)", UserWarning,
                  stacklevel=outside_stacklevel())  # (the line that called load_state_dict)


def _complete_stock_part(module: nn.Module, state_dict, prefix: str, *rest) -> None:
    """The pre-hook of a patched model's parts (:func:`accept_stock_checkpoints`): a load started
    at the part itself (``patched.backbone.load_state_dict(stock_backbone_sd)``: ``prefix`` empty)
    is judged as the root's hook judges a whole model's load. Within a load of the whole model
    (a ``prefix``) the root's hook has judged the checkpoint as a whole: nothing here."""
    if not prefix:
        _complete_stock_checkpoint(module, state_dict, prefix, *rest)


_HOOKS = (_complete_stock_checkpoint, _complete_stock_part)


def accept_stock_checkpoints(root: nn.Module) -> None:
    """Let ``root.load_state_dict`` take a stock checkpoint, as :func:`load_stock_checkpoint`
    does (``patch_model`` calls it), and so every part of ``root`` that holds a quantizer (a
    load started there: a stock backbone's weights into a patched detector's backbone). One
    whole-model hook per patched model: a part patched on its own first (a plan patches block
    by block) gives its hook to ``root``, so a checkpoint of the whole model is judged stock or
    patched as a whole, never part by part."""
    modules = list(root.named_modules())
    holders = set()  # the qualified names of every module with a quantizer under it
    for name, m in modules:
        hooks = m._load_state_dict_pre_hooks
        for hook_id in [i for i, h in hooks.items() if getattr(h, "hook", None) in _HOOKS]:
            del hooks[hook_id]
        if isinstance(m, ActivationQuantizer):
            parts = name.split(".")
            holders.update(".".join(parts[:i]) for i in range(1, len(parts)))
    root.register_load_state_dict_pre_hook(_complete_stock_checkpoint)
    for name, m in modules:
        if name in holders:
            m.register_load_state_dict_pre_hook(_complete_stock_part)


def load_stock_checkpoint(model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
    """Load a stock checkpoint into a patched model; estimates restart from the next batch."""
    root = unwrap_module(model, "load_stock_checkpoint")
    return root.load_state_dict(stock_to_patched_state_dict({_strip(k): v for k, v in state_dict.items()}, root),
                                strict=strict)


def load_patched_checkpoint(model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
    """Load a patched model's checkpoint into a stock (unpatched) model."""
    root = unwrap_module(model, "load_patched_checkpoint")
    return root.load_state_dict(patched_to_stock_state_dict({_strip(k): v for k, v in state_dict.items()}),
                                strict=strict)
