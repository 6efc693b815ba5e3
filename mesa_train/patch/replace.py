"""Putting a converted module in the place of the stock one: in every parent that holds it, with
its hooks (``patch_model``'s leaf pass and the scale-branch pass, ``patch/scale_branch.py``)."""
from __future__ import annotations

from typing import Dict, List, Tuple

from torch import nn
from torch.nn.modules.module import _WrappedHook

__all__ = ["Parents", "hand_over_children", "replace_child"]

# {id(module): [(parent, key), ...]}: a module may sit under several parents (shared children)
Parents = Dict[int, List[Tuple[nn.Module, str]]]

# the hook tables of nn.Module (forward, backward, state_dict), each an ordered dict of id -> hook
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_state_dict_pre_hooks",
                "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def replace_child(parents: Parents, old: nn.Module, new: nn.Module) -> None:
    for parent, key in parents.get(id(old), []):
        parent._modules[key] = new
    _carry_hooks(old, new)


def _carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """The hooks registered on ``old`` go on with ``new``: its tables become ``old``'s (with
    ``new``'s own entries after them), so a handle taken before patching still removes its hook.
    Before, they were dropped without a word: timm's ``FeatureHookNet`` lost a feature map, a
    user's forward or backward hook on a Linear or activation never ran again."""
    for table in _HOOK_TABLES:
        hooks = getattr(old, table, None)
        if not hooks:
            continue
        for key, hook in hooks.items():  # (a wrapper bound to the old module: the new one's)
            if isinstance(hook, _WrappedHook) and hook.with_module and hook.module() is old:
                hooks[key] = _WrappedHook(hook.hook, new)
        hooks.update(getattr(new, table))
        object.__setattr__(new, table, hooks)
    if getattr(old, "_is_full_backward_hook", None) is not None:
        object.__setattr__(new, "_is_full_backward_hook", old._is_full_backward_hook)


def hand_over_children(parents: Parents, old: nn.Module, new: nn.Module) -> None:
    """A converted module that took ``old``'s children (``BatchNormAct2d``'s ``drop`` / ``act``)
    is now their parent: their own conversion, later in the pass, replaces them in ``new``."""
    for key, child in new._modules.items():
        entries = parents.get(id(child), [])
        parents[id(child)] = [(new, k) if p is old else (p, k) for p, k in entries]
