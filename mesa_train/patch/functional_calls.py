"""Activations and pooling that a module's forward calls functionally, compressed through Mesa
children: ``F.relu(self.conv1(x))``, ``F.max_pool2d(x, 2)``, ``F.gelu(h)``, ``F.silu(h)``,
``F.avg_pool2d(x, 3, 1, 1)`` (hand-written CNNs, torchvision's Inception-v3 blocks: 0.367 ->
0.258 of stock bytes; GoogLeNet's auxiliary heads, DenseNet's last ReLU). There is no module
for the leaf conversion to reach, so stock autograd kept each call's input or output whole;
before, those calls were reported as "functional ops not reached" (ReLU, GELU) or not even
reported (SiLU, pooling).

``install`` gives the module one child per call site the source scan counts (``rules``; the
calls in ``forward`` and the methods it reaches on ``self``): ``mesa_call_relu_0``,
``mesa_call_relu_1``, ... The module's forward then runs under the capture mode of
``generic_attention``, which hands each such call to its site's child with the call's own
arguments (the layers' ``forward`` takes them: ``inplace``, ``approximate``, ``negative_slope``,
the pooling arguments): the same op, so the forward stays bitwise stock's. A kind of call is one
family of children: ``F.leaky_relu`` belongs to op ``relu`` but takes ``mesa_call_leaky_relu_<i>``
children (Mesa ``LeakyReLU``: GAN discriminators, DarkNet-style CNNs), ``F.relu`` the
``mesa_call_relu_<i>`` ones. One child per site because the
GELU's and SiLU's estimates are per tensor (sites of different scales must not share them); the
ReLU and the pools keep no estimates, but the same naming keeps the rule one.

A site is the place in the module's own code that makes the call (its frame's code object and
instruction), found by walking up from the capture: a call made by a child module's forward (a
stock ``nn.GELU`` of a module set not asked for, a frozen sub-network's stock fallbacks) is not
the module's and runs as it would; a site is given the next free child the first time it runs,
and keeps it (a site in a branch taken on some steps keeps its estimates; a site in a loop runs
its one child each time, as a module called in a loop does). Under ``torch.compile`` there are
no frames to read: the n-th call of a forward takes the n-th child, the same assignment for
code without branches. ``F.silu(x, inplace=True)``: Mesa's SiLU computes out of place, and the
result is copied into ``x`` (code may rely on ``x`` being overwritten). Calls from code the
scan does not read (a plain function outside the class) and ``F.max_pool2d(...,
return_indices=True)`` (the caller keeps the int64 indices anyway) run stock. An op with any
call of another form (``relu6``, ``hardtanh`` map to ``relu`` too) stays reported.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .rules import count_functional_calls, methods_reached_code

__all__ = ["CALL_KINDS", "FUNCTION_CHILDREN_ATTR", "install", "own_call", "route", "routable_sites"]

# set on a module given call children: {kind: (child name, ...)} in call order
FUNCTION_CHILDREN_ATTR = "_mesa_function_children"
# set on such a module as its sites run: {op: {site: child index}}, a site being its code's
# (file, first line, name) and the call's instruction offset: plain values, so a module that has
# run still pickles (torch.save of the whole model) and deep-copies with its sites
FUNCTION_SITES_ATTR = "_mesa_function_sites"
# the files between a module's own call and the capture's handler: torch's Python functions
# (F.relu, F.silu, torch.einsum; F.max_pool2d through torch._jit_internal's boolean dispatch), its dispatch to
# the mode, and this package's handler (generic_attention._Capture)
_PASSED_FILES = {torch.nn.functional.__file__, torch.overrides.__file__, torch._jit_internal.__file__, __file__,
                 torch.functional.__file__,  # (torch.einsum's Python wrapper)
                 os.path.join(os.path.dirname(__file__), "generic_attention.py")}

# the functions the capture mode sees for each kind of routed call (F.relu_ is torch.relu_;
# x.relu() is Tensor.relu; F.leaky_relu_ is torch._C._nn.leaky_relu_), and whether that function
# works in place
_FUNCTIONS = {
    F.relu: ("relu", False), torch.relu: ("relu", False), torch.Tensor.relu: ("relu", False),
    torch.relu_: ("relu", True), torch.Tensor.relu_: ("relu", True),
    F.leaky_relu: ("leaky_relu", False), F.leaky_relu_: ("leaky_relu", True),
    F.gelu: ("gelu", False), F.silu: ("silu", False),
    F.max_pool2d: ("maxpool", False), torch.max_pool2d: ("maxpool", False), F.avg_pool2d: ("avgpool", False),
}
# kind -> (the op it belongs to, the call names, as the source scan reads them, its children compute)
CALL_KINDS = {"relu": ("relu", ("relu", "relu_")), "leaky_relu": ("relu", ("leaky_relu", "leaky_relu_")),
              "gelu": ("gelu", ("gelu",)), "silu": ("silu", ("silu",)), "maxpool": ("maxpool", ("max_pool2d",)),
              "avgpool": ("avgpool", ("avg_pool2d",))}


def _layer_factories() -> Dict[str, Callable[..., nn.Module]]:
    import mesa_train.nn as mnn  # (mesa_train.nn imports nothing of patch/; imported when patching)

    return {"relu": mnn.ReLU, "leaky_relu": mnn.LeakyReLU, "gelu": mnn.GELU, "silu": mnn.SiLU,
            "maxpool": lambda **kw: mnn.MaxPool2d(1, **kw), "avgpool": lambda **kw: mnn.AvgPool2d(1, **kw)}


def routable_sites(cls: type, op: str, all_names: Tuple[str, ...]) -> Optional[Dict[str, int]]:
    """The call sites of ``op`` in ``cls``'s forward a child can take, per kind of call
    (``{kind: sites}``, every kind of ``op``; all 0: there are none), or None where a call the
    scan maps to ``op`` (``all_names``: those call names) is of a form no child computes
    (``relu6`` for ``relu``)."""
    sites = {kind: sum(count_functional_calls(cls, name) for name in names)
             for kind, (kind_op, names) in CALL_KINDS.items() if kind_op == op}
    total = sum(count_functional_calls(cls, name) for name in all_names)
    return sites if sum(sites.values()) == total else None


def install(module: nn.Module, kind: str, sites: int, device, options: dict) -> None:
    """Give ``module`` ``sites`` children for its functional calls of ``kind`` (kept where present)."""
    make = _layer_factories()[kind]
    names = tuple(f"mesa_call_{kind}_{i}" for i in range(sites))
    for name in names:
        if name not in module._modules:
            module.add_module(name, make(device=device, **options))
    children = dict(getattr(module, FUNCTION_CHILDREN_ATTR, None) or {})
    children[kind] = names
    object.__setattr__(module, FUNCTION_CHILDREN_ATTR, children)


def _call(kind: str, inplace: bool, args, kwargs) -> Optional[dict]:
    """The call's arguments by name, or None for a form no child computes."""
    if kind in ("relu", "leaky_relu"):
        names = ("input", "inplace") if kind == "relu" else ("input", "negative_slope", "inplace")
        call = dict(zip(names, args), **kwargs)
        call["inplace"] = inplace or call.get("inplace", False)
    elif kind == "gelu":
        call = dict(zip(("input", "approximate"), args), **kwargs)
    elif kind == "silu":
        call = dict(zip(("input", "inplace"), args), **kwargs)
    elif kind == "maxpool":
        call = dict(zip(("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"),
                        args), **kwargs)
        if call.pop("return_indices", False):
            return None
    else:  # avgpool
        call = dict(zip(("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
                         "divisor_override"), args), **kwargs)
    x = call.get("input")
    return call if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter) else None


def _own_frame(owner: nn.Module, functions: bool = False):
    """The frame of ``owner``'s own code that made the call being captured (its forward, the
    methods it reaches; with ``functions``, the functions of its module they call), found by
    walking up past torch's Python functions and this package's handler; None for a call made
    by other code (a module nested in it). Eager only: there are no frames under compile."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in _PASSED_FILES:
        frame = frame.f_back
    if frame is None or frame.f_code not in methods_reached_code(type(owner), functions):
        return None
    return frame


def _site(owner: nn.Module, kind: str, counts: Dict[str, int]) -> Optional[int]:
    """The child index of this call's site (module doc), or None for a call that is not the
    module's own. ``counts``: this forward's calls per kind so far (under torch.compile)."""
    if torch.compiler.is_compiling():
        site = counts.get(kind, 0)
        counts[kind] = site + 1
        return site
    frame = _own_frame(owner)
    if frame is None:
        return None
    code = frame.f_code
    sites = owner.__dict__.setdefault(FUNCTION_SITES_ATTR, {}).setdefault(kind, {})
    return sites.setdefault((code.co_filename, code.co_firstlineno, code.co_name, frame.f_lasti), len(sites))


def own_call(owner: nn.Module) -> bool:
    """Whether the call being captured is made by ``owner``'s own code (its forward, the
    methods it reaches and the functions of its module they call), not by a module nested in
    it; True under torch.compile, where there are no frames to read (call order decides)."""
    return torch.compiler.is_compiling() or _own_frame(owner, functions=True) is not None


def route(owner: nn.Module, counts: Dict[str, int], func, args, kwargs):
    """The result of the functional call ``func(*args, **kwargs)`` through ``owner``'s child for
    its site, or None where it runs stock (a call not the module's own, a site past the children,
    a form no child computes)."""
    entry = _FUNCTIONS.get(func)
    children = getattr(owner, FUNCTION_CHILDREN_ATTR, None)
    if entry is None or not children or entry[0] not in children:
        return None
    kind, inplace = entry
    site = _site(owner, kind, counts)
    names = children[kind]
    call = _call(kind, inplace, args, kwargs) if site is not None and site < len(names) else None
    if call is None:
        return None
    child = owner._modules[names[site]]
    x = call.pop("input")
    # (through the module call: hooks and the saved-bytes meter see the child's own call)
    if kind == "relu":
        return child(x, call["inplace"])
    if kind == "leaky_relu":
        return child(x, call.get("negative_slope", 0.01), call["inplace"])
    if kind == "gelu":
        return child(x, call.get("approximate", "none"))
    if kind == "silu":  # (Mesa's SiLU computes out of place; an in-place call's input takes the result)
        return x.copy_(child(x)) if call.get("inplace", False) else child(x)
    return child(x, call)
