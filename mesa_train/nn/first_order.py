"""Mesa backwards are first-order only: refused under ``create_graph=True``, whatever ``g`` is.

A Mesa backward reads the saved 8-bit copy, a constant, where the stock backward reads the
input: it is not a differentiable graph of the input. torch's ``@once_differentiable`` refuses
a double backward only when an incoming gradient itself requires grad; a gradient penalty
(``autograd.grad(loss, x, create_graph=True)``) whose loss reaches a Mesa layer through ops
with no parameters hands it a constant ``g``, and the gradient that layer returned carried no
second-order term, without a word (a Linear -> Mesa GELU with the learned estimator's Python
Function: the penalty's weight gradient 15.45 where stock's is 20.33). :func:`first_order`
refuses whenever grad mode is on in backward (what ``create_graph=True`` sets), in one line, as
the C++ layers' ``check_first_order`` (csrc/layers_common.h) does. Dynamo traces a first-order
backward with grad mode off, so compiled training passes the check; under compiled autograd a
penalty is refused too (an exemption while compiling, the first version, let one through with a
wrong gradient: 51.6 where stock's is 121.5).
"""
from __future__ import annotations

import functools

import torch

__all__ = ["first_order", "refuse_higher_order"]


def refuse_higher_order(layer: str) -> None:
    """Raise the one-line error for a higher-order gradient through the Mesa ``layer``."""
    raise RuntimeError(
        f"mesa: higher-order gradients (backward with create_graph=True) through a Mesa {layer} are not "
        "supported: its backward uses the saved 8-bit copy, not a differentiable graph. Run that part of the "
        "model stock (enabled=False, or unpatched) for them.")


# the layer's words where the Function's name would not say them (as the C++ nodes' lines say them)
_DISPLAY = {"_ElementwiseFn": "activation", "_HardswishFn": "activation", "_ClampMaskFn": "activation",
            "_GatedFn": "gated activation", "_GeluFn": "GELU", "_GeluLinearFn": "GELU + Linear",
            "_LayerNormLinearFn": "LayerNorm + Linear", "_ScaleFn": "layer scale", "_GrnFn": "GlobalResponseNorm",
            "_Norm2dFn": "RmsNorm2d / SimpleNorm", "_ScaleBranchFn": "BatchNorm scale branch",
            "_MesaSDPA": "ScaledDotProductAttention", "_MesaQueryBiasSDPA": "ScaledDotProductAttention",
            "_EluFn": "ELU"}


def _layer_name(ctx) -> str:
    """The layer the refused backward belongs to: ``_LinearFn`` -> ``Linear``, or ``_DISPLAY``'s
    words. (``ctx._forward_cls``: under compiled autograd ``ctx`` is a stand-in class.)"""
    name = getattr(ctx, "_forward_cls", type(ctx)).__name__
    if name in _DISPLAY:
        return _DISPLAY[name]
    name = name.lstrip("_")
    return name[:-len("Fn")] if name.endswith("Fn") else name


def first_order(backward):
    """Decorate a Mesa ``autograd.Function.backward`` (in place of ``@once_differentiable``)."""
    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled():
            refuse_higher_order(_layer_name(ctx))
        return backward(ctx, *grads)
    return checked
