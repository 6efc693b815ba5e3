"""Attention reached generically: any module whose forward ends in
``F.scaled_dot_product_attention``, or in ``q @ k^T``, softmax and ``@ v``, is compressed by
intercepting those functional calls while the module runs.

No timm code is copied or rewritten, so this reaches EVA (incl. rope), BEiT, CaiT (class and
talking-heads attention), XCiT, relative-position attention, ``ParallelScalingBlock``,
attention-pool heads and the like, whatever they do around the core (rope, qk-norm, masks,
biases). ``install`` gives such a module four Mesa children and a ``forward`` that runs the
class's forward with a ``TorchFunctionMode`` entered (:func:`_mesa_captured_forward`):

``mesa_sdpa``     the module's ``F.scaled_dot_product_attention`` call (int8 q, k, v)
``mesa_qk``       its first batched (>= 3-D x >= 3-D) matmul of the call: ``q @ k^T``
``mesa_softmax``  its first softmax: the attention map (over the last dim; int8 output,
                  offered for sharing), or one over another dim (CoaT's keys over the tokens)
``mesa_av``       its second batched matmul: ``attn @ v`` (the map is the softmax's shared
                  int8 copy when it comes straight from it; else quantized itself)

Each is the Mesa layer computing exactly the intercepted call, so the forward stays bitwise
the stock one (a softmax with ``dtype=``, Hugging Face's eager attention: its input cast
first, as ATen does). Anything else (a third matmul, ``enable_gqa``, einsum, non-batched
products with weights) runs unchanged. Groups are per head (dim 1 of
``(B, heads, N, d)`` tensors). The Mesa layers fall back to stock in eval mode or without
grad, and the mode is popped while their own ops run (a mode is never re-entered from its
handler), so nothing is intercepted twice.
"""
from __future__ import annotations

import types
import warnings
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from mesa_train.warning_site import outside_stacklevel

from . import functional_calls
from .rules import count_functional_calls, matmul_kinds, scalar_product_scales, scan_functional_ops

__all__ = ["AMAX_CHILD", "CORE_REPEATS_ATTR", "EINSUM_CHILD", "EINSUM_CORE", "capture_calls", "install",
           "install_routed", "install_cosine", "install_linear", "install_scales", "is_generic_attention", "CHILDREN",
           "GENERIC_ATTENTION_ATTR", "SCALES_ATTR"]

CHILDREN = ("mesa_sdpa", "mesa_qk", "mesa_softmax", "mesa_av")
GENERIC_ATTENTION_ATTR = "_mesa_generic_attention"
# set when the forward has a single functional softmax: it is routed over any dim
SOFTMAX_ANY_DIM_ATTR = "_mesa_softmax_any_dim"
# set on a module whose forward runs its core once per head in a loop (rules.core_in_loop:
# EfficientViT-M's cascade): the products take the q.k and attn.v roles in turn, every softmax
# is the core's, and the children (per-sample ranges: each head its own input) serve every head
CORE_REPEATS_ATTR = "_mesa_core_repeats"
# set where a module nested in the attention multiplies batched tensors itself (a relative-position
# child's q @ table^T): a captured product is then the core's only when the attention's own code
# made it (functional_calls.own_call, a walk up the frames, spared to every other attention)
NESTED_PRODUCTS_ATTR = "_mesa_nested_products"
SCALES_ATTR = "_mesa_scales"  # {parameter name: ChannelScale child name}
_SECOND_CORE_SAID: set = set()  # the module classes whose second attention core was reported
_MATMULS = {torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.bmm}
_SOFTMAXES = {torch.softmax, torch.Tensor.softmax, F.softmax}
_MULS = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
_AMAXES = {torch.amax, torch.Tensor.amax}
AMAX_CHILD = "mesa_amax"
EINSUM_CHILD = "mesa_einsum"
MATMUL_ROLES = ("mesa_qk", "mesa_av")  # the core's q @ k^T and attn @ v, in the order they run
# an attention whose products are einsums only: its first two batched einsums, q.k and attn.v
EINSUM_CORE = ("mesa_einsum_qk", "mesa_einsum_av")
NORMALIZE_CHILDREN = ("mesa_norm_q", "mesa_norm_k")


def is_generic_attention(module: nn.Module) -> bool:
    return getattr(module, GENERIC_ATTENTION_ATTR, None) is not None


def _batched(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 3 and not isinstance(t, nn.Parameter)


def _softmax_dim(args, kwargs) -> Optional[int]:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return dim if isinstance(dim, int) else None


def _second_core(owner: nn.Module, what: str) -> None:
    """Say once per module class, in eager training, that its forward ran ``what`` after the
    attention core the children compress (a decoder layer's cross-attention after its
    self-attention, EfficientViT-M's cascade of heads, ConViT's positional softmax): that part
    runs stock. (Not under torch.compile: a warning would break the graph; not in eval or
    without gradients, where the whole module runs stock anyway.)"""
    if (type(owner) in _SECOND_CORE_SAID or torch.compiler.is_compiling() or not owner.training
            or not torch.is_grad_enabled()):
        return
    _SECOND_CORE_SAID.add(type(owner))
    warnings.warn(f"mesa_train: {type(owner).__name__}'s forward ran {what} after the attention core its Mesa "
                  "children compress (q @ k^T, one softmax, attn @ v): that part stays uncompressed. A module per "
                  "attention (as timm's blocks have) compresses each", UserWarning, stacklevel=outside_stacklevel())


def _softmax_input(func, args, kwargs) -> torch.Tensor:
    """The tensor the softmax call normalises: its input, cast to the call's ``dtype`` where one
    is given (Hugging Face's eager attention, ``F.softmax(w, dim=-1, dtype=torch.float32)``:
    ATen casts the input first, then takes the softmax, the same bits). ``F.softmax`` hands its
    defaults on (``_stacklevel`` third, ``dtype=None``); ``torch.softmax`` and
    ``Tensor.softmax`` take the dtype third."""
    dtype = kwargs.get("dtype")
    if dtype is None and func is not F.softmax and len(args) > 2:
        dtype = args[2]
    return args[0] if dtype is None else args[0].to(dtype)


class _Capture(TorchFunctionMode):
    """Routes one forward's attention calls of ``owner`` to its Mesa children."""

    def __init__(self, owner: nn.Module):
        super().__init__()
        self.owner = owner
        # the core's products so far, @ and einsum alike: the first is q.k, the second attn.v
        # (a mixed core, einsum for one and @ for the other, has one child of each kind)
        self.products = 0
        self.softmaxes = 0
        self.normalizes = 0
        self.calls: dict = {}  # functional activation / pooling calls per op (functional_calls.route)
        self.logits = None  # the q @ k^T output, for a logit scale multiplying it
        # the softmax's output and its 8-bit copy, handed to `attn @ v` when that multiplies
        # the output itself: unlike the eager-only sharing cache this holds under torch.compile
        self.probs = self.probs_copy = None

    def _next_role(self) -> int:
        """The role of the core product being captured: 0 for q.k, 1 for attn.v, 2 and on for
        products past the core; in a core run once per head (``CORE_REPEATS_ATTR``) the roles
        come round again for the next head."""
        role = self.products
        self.products += 1
        if role > 1 and getattr(self.owner, CORE_REPEATS_ATTR, False):
            role %= 2
        return role

    def _einsum_core(self, args, kwargs):
        """An einsum-only attention's products (lucidrains' ``einsum('b h i d, b h j d -> b h i
        j', q, k)`` and ``einsum('b h i j, b h j d -> b h i d', attn, v)``): the first batched
        einsum through ``mesa_einsum_qk``, the second through ``mesa_einsum_av``, each with its
        own estimates; an einsum with a parameter (DeepViT's re-attention mixing the heads) or a
        small operand is not one of them. None: the call runs as it is."""
        operands = _einsum_operands(args, kwargs)
        # (two batched activations of one batch: a position table indexed to 3-D is not one)
        if operands is None or not all(_batched(t) for t in operands) or operands[0].shape[0] != operands[1].shape[0]:
            return None
        if not functional_calls.own_call(self.owner):  # (an attention nested in this module runs its own)
            return None
        role = self._next_role()
        if role >= len(EINSUM_CORE):
            _second_core(self.owner, "a third batched product")
            return None
        child = self.owner._modules.get(EINSUM_CORE[role])
        return None if child is None else child(args[0], *operands)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        # (grad mode is off inside a Mesa layer's autograd.Function.forward: its own F.linear
        # and x * gamma are never routed again)
        if func is F.linear and torch.is_grad_enabled():
            routed = _route_linear(owner, args, kwargs)
            if routed is not None:
                return routed
        if torch.is_grad_enabled():
            routed = functional_calls.route(owner, self.calls, func, args, kwargs)
            if routed is not None:
                return routed
        if func in _MULS and len(args) == 2 and not kwargs and torch.is_grad_enabled():
            routed = _route_scale(owner, args[0], args[1])
            if routed is None and self.logits is not None:
                routed = _route_logit_scale(owner, self.logits, args[0], args[1])
            if routed is not None:
                return routed
        if func is F.normalize and self.normalizes < 2 and "mesa_norm_q" in owner._modules:
            names = ("input", "p", "dim", "eps")
            call = dict(zip(names, args), **kwargs)
            x, dim = call.get("input"), call.get("dim", 1)
            if (call.get("p", 2.0) == 2 and call.get("out") is None and _batched(x) and isinstance(dim, int)
                    and dim % x.dim() == x.dim() - 1):
                child = owner._modules[NORMALIZE_CHILDREN[self.normalizes]]
                self.normalizes += 1
                return child(x, dim=-1, eps=call.get("eps", 1e-12))
        if func is torch.einsum and torch.is_grad_enabled() and (EINSUM_CORE[0] in owner._modules
                                                                 or EINSUM_CORE[1] in owner._modules):
            routed = self._einsum_core(args, kwargs)
            if routed is not None:
                return routed
        if func is torch.einsum and EINSUM_CHILD in owner._modules and torch.is_grad_enabled():
            operands = _einsum_operands(args, kwargs)
            if operands is not None:
                return owner._modules[EINSUM_CHILD](args[0], *operands)
        if func in _AMAXES and AMAX_CHILD in owner._modules and torch.is_grad_enabled():
            call = dict(zip(("input", "dim", "keepdim"), args), **kwargs)
            if call.get("out") is None and isinstance(call.get("input"), torch.Tensor):
                return owner._modules[AMAX_CHILD](call["input"], call.get("dim", ()), call.get("keepdim", False))
        if func is F.scaled_dot_product_attention and "mesa_sdpa" in owner._modules and not kwargs.get("enable_gqa"):
            q, k, v, *rest = args
            names = ("attn_mask", "dropout_p", "is_causal", "scale")
            call = dict(zip(names, rest), **kwargs)
            return owner.mesa_sdpa(q, k, v, **call)
        if func is torch.baddbmm and self.products == 0 and "mesa_qk" in owner._modules:
            # q @ k^T fused with its scale and bias (diffusers' attention: baddbmm(empty, q, k^T,
            # beta=0, alpha=scale)), which no MatMul computes bit for bit: stock (reported as a
            # matmul not reached), counted as the first product, so attn @ v still reaches mesa_av
            self.products += 1
            self.logits = func(*args, **kwargs)
            return self.logits
        if (func in _MATMULS and len(args) == 2 and _batched(args[0]) and _batched(args[1]) and not kwargs
                and ("mesa_qk" in owner._modules or "mesa_av" in owner._modules)
                and (not owner.__dict__.get(NESTED_PRODUCTS_ATTR) or functional_calls.own_call(owner))):
            role = self._next_role()
            if role == 0 and "mesa_qk" in owner._modules:
                logits = owner.mesa_qk(args[0], args[1])
                if torch.compiler.is_compiling():
                    # a new tensor, not the traced Function's output: Dynamo treats that as a
                    # view of a multi-output node, which may not be modified in place, and
                    # MViTv2 adds its relative positions into the logits in place
                    logits = logits.clone()
                self.logits = logits
                return logits
            if role == 1 and "mesa_av" in owner._modules:
                self.logits = None
                shared = self.probs_copy if args[0] is self.probs else None
                return owner.mesa_av(args[0], args[1], shared_a=shared)
            if role > 1:
                _second_core(owner, "a third batched product")
        if func is F.dropout and self.probs is not None and args and args[0] is self.probs:
            call = dict(zip(("input", "p", "training", "inplace"), args), **kwargs)
            if call.get("p", 0.5) == 0 or not call.get("training", True):
                # a dropout that drops nothing is the map itself, as eager's F.dropout returns
                # it; Dynamo in torch 2.11 gives that output a new identity, and attn @ v
                # would no longer be handed the softmax's copy
                return self.probs
        if (func in _SOFTMAXES and _batched(args[0]) and "mesa_softmax" in owner._modules
                and (self.softmaxes == 0 or getattr(owner, CORE_REPEATS_ATTR, False))):
            dim = _softmax_dim(args, kwargs)
            last = dim is not None and dim % args[0].dim() == args[0].dim() - 1
            # over the last dim (the attention map), or over another when that softmax is the
            # forward's only one (CoaT's factorized attention normalises its keys over the
            # tokens: k.softmax(dim=2)); otherwise it may precede the map, which is routed
            if last or (dim is not None and getattr(owner, SOFTMAX_ANY_DIM_ATTR, False)):
                self.softmaxes += 1
                x = _softmax_input(func, args, kwargs)
                self.probs, self.probs_copy = owner.mesa_softmax(x, with_copy=True, dim=None if last else dim)
                return self.probs
        if func in _SOFTMAXES and self.softmaxes and "mesa_softmax" in owner._modules and _batched(args[0]):
            _second_core(owner, "a second softmax")
        return func(*args, **kwargs)


def _einsum_operands(args, kwargs):
    """The two tensor operands of ``torch.einsum(equation, a, b)`` (or ``(equation, [a, b])``),
    else None."""
    if kwargs or len(args) < 2 or not isinstance(args[0], str):
        return None
    operands = args[1:] if len(args) != 2 or isinstance(args[1], torch.Tensor) else tuple(args[1])
    return operands if len(operands) == 2 and all(isinstance(t, torch.Tensor) for t in operands) else None


def _route_linear(owner, args, kwargs):
    """``F.linear(x, weight=self.qkv.weight, bias=qkv_bias)`` (BEiT, SwinV2: q/v biases
    concatenated at call time) bypasses the converted ``qkv`` child: run it through that Mesa
    ``Linear``'s Function and quantizer (int8 input, same output bits)."""
    from mesa_train.nn import Linear

    names = ("input", "weight", "bias")
    call = dict(zip(names, args), **kwargs)
    x, weight, bias = call.get("input"), call.get("weight"), call.get("bias")
    if not isinstance(weight, nn.Parameter) or not isinstance(x, torch.Tensor) or isinstance(x, nn.Parameter):
        return None
    for child in owner._modules.values():
        if isinstance(child, Linear) and child.weight is weight and child._mesa_active(x, weight, bias):
            return child(x, call_bias=bias)
    return None


def _route_scale(owner, a, b):
    """``self.gamma_1 * y`` with a direct ``(C,)`` parameter of ``owner`` (inline layer scale), or
    ``self.layer_scale * y`` with a ``(C, 1, 1)`` one on NCHW (torchvision's ConvNeXt): through
    its ``ChannelScale`` child (int8 ``y``)."""
    scales = getattr(owner, SCALES_ATTR, None)
    if not scales:
        return None
    params = owner._parameters
    for gamma, x in ((a, b), (b, a)):
        if not isinstance(gamma, nn.Parameter) or not isinstance(x, torch.Tensor) or isinstance(x, nn.Parameter):
            continue
        for pname, child in scales.items():
            if params.get(pname) is gamma and (
                    (gamma.dim() == 1 and x.dim() >= 2 and x.shape[-1] == gamma.numel())
                    or (gamma.dim() == 3 and x.dim() == 4 and x.shape[1] == gamma.shape[0])):  # (C, 1, 1): NCHW
                return owner._modules[child](x, gamma)
    return None


def _route_logit_scale(owner, logits, a, b):
    """``(q @ k^T) * scale`` with a learned per-head scale (SwinV2's ``logit_scale.exp()``,
    XCiT's ``temperature``: ``(heads, 1, 1)``-like, requires grad) or one learned scalar
    (lucidrains' LSA: ``dots * self.temperature.exp()``, 0-d): through ``mesa_logit_scale``
    (int8 logits, per-head groups), so the full-precision logits are not kept for its gradient.
    A scalar goes in as it is, whatever its dtype: ``x * s`` is stock's own product (under
    autocast bf16 logits times the float32 scalar, a bf16 product), the logits are kept with
    per-head groups and the scalar's gradient is ``sum(g * logits_hat)``."""
    child = owner._modules.get("mesa_logit_scale")
    if child is None:
        return None
    for x, s in ((a, b), (b, a)):
        if x is not logits or not isinstance(s, torch.Tensor) or not s.requires_grad or x.dim() != 4:
            continue
        if s.dim() >= 2 and s.numel() == x.shape[1] and s.shape[-1] == 1 and s.shape[-2] == 1:
            return child(x, s)
        if s.dim() == 0:  # (as it is: x * s is stock's own product, also under autocast, where
            # bf16 logits meet the float32 scalar and the product stays bf16)
            return child(x, s)
    return None


def _scalar_scale(module: nn.Module) -> bool:
    """A learned scalar that the forward multiplies a product by (LSA's ``matmul(q, k^T) *
    self.temperature.exp()``, ``rules.scalar_product_scales``): a candidate logit scale. Any
    other use (ReZero's ``x + self.alpha * out``, a division) would give a child that never runs."""
    names = scalar_product_scales(type(module))
    return any(p.dim() == 0 and p.requires_grad for n, p in module.named_parameters(recurse=False) if n in names)


def install_cosine(module: nn.Module, ops, found, heads: Optional[int], device, options) -> Tuple[str, ...]:
    """Cosine attention (SwinV2, SwinV2-CR, XCiT): ``mesa_norm_q`` / ``mesa_norm_k`` for its
    first two ``F.normalize(., dim=-1)`` calls (op ``normalize``) and ``mesa_logit_scale`` for
    a learned per-head scale of the logits (op ``layerscale``; only when the module holds a
    parameter with one value per head). Needs the ``mesa_qk`` routing (op ``matmul``).

    An ``F.normalize`` found only in a module-level function the forward calls counts where
    the module holds that per-head scale: torchvision's ``shifted_window_attention`` serves
    Swin V1 and V2 and normalizes only when handed V2's ``logit_scale`` (V1 got two children
    that never ran, which ``describe`` counted)."""
    from mesa_train.nn import ChannelScale, Normalize

    if "mesa_qk" not in module._modules:
        return ()
    added = []
    per_head = heads is not None and any(p.numel() == heads and p.dim() >= 1 for p in module.parameters(recurse=False))
    normalizes = "normalize" in found and (per_head or "normalize" in scan_functional_ops(type(module)))
    if "normalize" in ops and normalizes and "mesa_norm_q" not in module._modules:
        for n in NORMALIZE_CHILDREN:
            module.add_module(n, Normalize(device=device, **options))
        added.append("normalize")
    if "layerscale" in ops and (per_head or _scalar_scale(module)) and "mesa_logit_scale" not in module._modules:
        module.add_module("mesa_logit_scale", ChannelScale(device=device, **options))
        added.append("layerscale")
    return tuple(added)


def capture_calls(owner: nn.Module) -> TorchFunctionMode:
    """The mode that routes ``owner``'s attention calls to its Mesa children while entered (for
    a swapped class whose forward enters it only where it needs it: ``patch/sam.py``)."""
    return _Capture(owner)


def _mesa_captured_forward(self, *args, **kwargs):
    """The module's own forward with its capture mode entered: bound to the instance as its
    ``forward`` by :func:`_install_capture`, the class's forward unchanged. A ``with`` leaves
    the mode even when the forward raises. One function for every patched module, bound as a
    method: torch.compile per block guards on the function, not on the module, so identical
    blocks share one graph (capture hooks registered per module with ``always_call=True`` gave
    EVA-02 one graph per block: Dynamo guarded on each hook's id; a ``functools.partial``
    gave one per block on torch 2.11, which guards on each partial's id)."""
    with _Capture(self):
        return type(self).forward(self, *args, **kwargs)


# the name the bound method pickles by: a bound method is unpickled as getattr(module, its
# function's name), before the module's own attributes are restored, so the module's class
# carries the function under that name (an added private method; the class's forward and
# every other attribute stay as they are)
_CAPTURED_FORWARD = _mesa_captured_forward.__name__


def install(module: nn.Module, ops, heads: Optional[int], device, make_options,
            einsum_role: Optional[int] = None) -> Optional[str]:
    """Give ``module`` the Mesa children for the requested ``ops`` (``sdpa``, ``matmul``,
    ``softmax``) and the capturing forward; returns what was installed (for ``describe``).
    ``einsum_role``: a mixed core whose q.k (0) or attn.v (1) is an einsum (its ``EINSUM_CORE``
    child is installed by the caller): no ``MatMul`` child for that product."""
    from mesa_train.nn import MatMul, Softmax
    from mesa_train.nn.sdpa import ScaledDotProductAttention

    opts = make_options(heads)
    added = []
    if "sdpa" in ops and getattr(module, "mesa_sdpa", None) is None:
        module.mesa_sdpa = ScaledDotProductAttention(device=device, **opts)
        added.append("sdpa")
    if "matmul" in ops and einsum_role is not None:
        name = MATMUL_ROLES[1 - einsum_role]
        if not isinstance(module._modules.get(name), MatMul) or name == "mesa_av" and not module.mesa_av.operands:
            setattr(module, name, MatMul(device=device, **opts))
            added.append("matmul")
    elif "matmul" in ops and (module._modules.get("mesa_qk") is None or isinstance(module.mesa_qk, PassThroughMatMul)):
        # (replacing a softmax-only patch's pass-through q @ k^T and share-only attn @ v)
        module.mesa_qk = MatMul(device=device, **opts)
        module.mesa_av = MatMul(device=device, **opts)
        added.append("matmul")
    if "softmax" in ops and getattr(module, "mesa_softmax", None) is None:
        module.mesa_softmax = Softmax(dim=-1, device=device, **opts)
        added.append("softmax")
    if "softmax" in ops:
        single = count_functional_calls(type(module), "softmax", functions=True) == 1
        object.__setattr__(module, SOFTMAX_ANY_DIM_ATTR, single)
    if "softmax" in ops and "matmul" not in ops and getattr(module, "mesa_av", None) is None:
        # the map kept once through the softmax's shared copy, v as stock (share-only)
        module.mesa_qk = PassThroughMatMul()
        module.mesa_av = MatMul(operands=(), device=device, **opts)
    if not any(n in module._modules for n in CHILDREN):
        return None
    module.__dict__[NESTED_PRODUCTS_ATTR] = any(
        matmul_kinds(type(c), functions=True) for c in module.modules()
        if c is not module and type(c).__module__.split(".")[0] not in ("torch", "mesa_train"))
    _install_capture(module)
    return ",".join(o for o in ("sdpa", "matmul", "softmax") if o in ops)


def _install_capture(module: nn.Module) -> None:
    """Run ``module``'s forward under its capture mode (:func:`_mesa_captured_forward`, bound
    as an instance attribute: the class, and what is keyed on it, stay the stock ones)."""
    if not is_generic_attention(module):
        setattr(type(module), _CAPTURED_FORWARD, _mesa_captured_forward)
        module.__dict__["forward"] = types.MethodType(_mesa_captured_forward, module)
        object.__setattr__(module, GENERIC_ATTENTION_ATTR, True)


def install_linear(module: nn.Module) -> bool:
    """Hook ``module`` so that its functional ``F.linear`` calls with a converted child's
    weight go through that Mesa ``Linear`` (see ``_route_linear``)."""
    _install_capture(module)
    return True


def install_routed(module: nn.Module, child: str, make_layer: Callable[[], nn.Module]) -> None:
    """Route ``module``'s calls that ``_Capture`` hands to ``child`` (``AMAX_CHILD``: inline
    ``x.amax(...)``, max pooling as a reduction; ``EINSUM_CHILD``: two-operand ``torch.einsum``,
    also in module-level functions its forward calls) through ``make_layer()``, built unless the
    module has that child already, and give the module the capturing forward."""
    if child not in module._modules:
        module.add_module(child, make_layer())
    _install_capture(module)


def install_calls(module: nn.Module, kind: str, sites: int, device, options: dict) -> None:
    """Route ``module``'s functional calls of ``kind`` (``F.relu``, ``F.leaky_relu``,
    ``F.max_pool2d``, ...) through a Mesa child per call site (patch/functional_calls.py) under
    the capturing forward."""
    functional_calls.install(module, kind, sites, device, options)
    _install_capture(module)


def install_scales(module: nn.Module, names, device, options) -> Tuple[str, ...]:
    """Give ``module`` a ``ChannelScale`` child per inline layer-scale parameter in ``names``
    and the capturing forward; returns the parameter names handled."""
    from mesa_train.nn.layerscale import ChannelScale

    scales = dict(getattr(module, SCALES_ATTR, None) or {})
    for pname in names:
        child = f"mesa_scale_{pname}"
        if child not in module._modules:
            module.add_module(child, ChannelScale(device=device, **options))
        scales[pname] = child
    if scales:
        object.__setattr__(module, SCALES_ATTR, scales)
        _install_capture(module)
    return tuple(scales)


class PassThroughMatMul(nn.Module):
    """``a @ b`` unchanged (the ``q @ k^T`` of a softmax-only patch)."""

    def forward(self, a, b):
        return torch.matmul(a, b)
