"""Mesa ``Softmax``: exact forward, saves only its 8-bit output (per-head groups for 4-D).

Backward renormalises each dequantized row to sum 1 (a bias added to a whole row of logits
keeps its zero gradient; DESIGN.md, "Softmax backward renormalises the dequantized rows").
Over the last dim with the groups along another dim (4-D attention maps) and the default
8-bit format, that whole backward is one op, ``mesa::softmax_backward`` (also under
``torch.compile`` with traceable kernels; its traced form only without the extension:
``compile_kernels.traced_row_sums``), which reads the codes and the gradient once; other
layouts and the variant formats dequantize, renormalise and call ``_softmax_backward_data``.

The compressed output can be reused by a Mesa ``MatMul`` whose left operand is this output
(``attn @ v``) instead of quantizing it again: :meth:`Softmax.forward_with_copy` hands it
over explicitly (what the patched attention modules do; this also works under
``torch.compile``), and in eager mode it is also offered to :mod:`mesa_train.nn.sharing`
for consumers that cannot be handed it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mesa_train.quant import traceable
from mesa_train.quant.compile_kernels import traced_as_pytorch, traced_row_sums

from .first_order import first_order
from . import sharing
from ._common import MesaLayer, group_dim_4d, load, no_autocast, rebuild_parameter_free, save
from .quantizer import Packed, decompress

__all__ = ["Softmax", "autocast_dtype_for"]


_SOFTMAX_BACKWARD = torch.ops.mesa.softmax_backward.default


def fused_backward(packed: Packed, softmax_dim: int) -> bool:
    """Whether backward can be the one op ``mesa::softmax_backward``: the paper's 8-bit format
    (codes of y's shape), the softmax over the last dim and the groups over another dim, so
    that every row has one (alpha, beta). (csrc/layers_autograd.cpp decides the same way.)"""
    last = packed.q.dim() - 1
    return packed.fmt is None and softmax_dim == last and packed.dim != last


def _fused_backward(g: torch.Tensor, p: Packed, y_dtype: torch.dtype, x_dtype: torch.dtype) -> torch.Tensor:
    """The gradient of x from g and the codes, in x's dtype. A half g with a float32 map
    (autocast: the map handed to ``attn @ v`` in g's dtype, ``out_dtype``) goes into the op as
    it is, and the result comes out in x's dtype, g's or float32 (float32 logits: Swin's,
    with their float32 bias): ``y_dtype`` / ``out_dtype`` stand for the casts of g up and of
    the result down (passes over the map saved, the same bits); otherwise g is cast to the
    map's dtype first and the result to x's after."""
    if y_dtype in (g.dtype, torch.float32) and (x_dtype == g.dtype or x_dtype == y_dtype == torch.float32):
        map_dtype, out_dtype = y_dtype, x_dtype
    else:
        g, map_dtype, out_dtype = g.to(y_dtype), None, None
    if traced_row_sums(p.q):  # under torch.compile with traceable kernels and no extension
        gx = traceable.softmax_backward(g, p.q, p.alpha, p.beta, p.dim, p.num_groups, map_dtype, out_dtype)
    else:
        gx = _SOFTMAX_BACKWARD(g, p.q, p.alpha, p.beta, p.dim, p.num_groups, map_dtype, out_dtype)
    return gx.to(x_dtype)


# device types autocast knows (torch.is_autocast_enabled raises on others, e.g. "meta")
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "privateuseone")


def autocast_dtype_for(t: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast's matmul would cast ``t`` to (None: autocast off on t's device, or
    a float64 ``t``, which autocast leaves alone)."""
    kind = t.device.type
    if t.dtype == torch.float64 or kind not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


class _SoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, quantizer, out_dtype):
        y = F.softmax(x, dim)  # exactly nn.Softmax.forward (dim already resolved)
        ctx.y_dtype, ctx.x_dtype, ctx.dim = y.dtype, x.dtype, dim  # (backward: the map in y's dtype)
        if out_dtype is not None and out_dtype != y.dtype:
            # the cast the consumer would make, before the compression: the copy is the map
            # `attn @ v` consumes (under CUDA autocast bf16, half the float32 map's bytes to
            # read; Inductor writes only the bf16 map)
            y = y.to(out_dtype)
        # y.detach(): compress never aliases the output itself. Under torch.compile in torch
        # 2.11 (fixed by 2.14), an op that returns its input (x.contiguous(), x.float() of a
        # contiguous float32 x) applied to an autograd.Function's output made the traced
        # backward receive zeros as that output's gradient.
        yd = y.detach()
        if traced_as_pytorch(yd) and quantizer.options.estimator != "delayed":
            # two passes (min/max, then the codes): the map stored before they read it, not
            # computed again from the logits by each (traceable.stored_here). The delayed
            # one-pass kernel computes it once anyway, and keeps Inductor's layout for it
            yd = traceable.stored_here(yd)
        packed = quantizer.compress(yd, group_dim_4d(y))
        sharing.offer(y, packed)
        save(ctx, [packed])
        # the codes and statistics are also outputs, so that a consumer can keep them
        # instead of quantizing y again (forward_with_copy); they carry no gradient
        ctx.mark_non_differentiable(packed.q, packed.alpha, packed.beta)
        ctx.set_materialize_grads(False)  # no zero-filled gradients for those three outputs
        ctx.packed_layout = (packed.dim, packed.num_groups)
        return y, packed.q, packed.alpha, packed.beta

    @staticmethod
    @first_order
    def backward(ctx, g, *_):
        if g is None:  # y itself did not reach the loss
            return None, None, None, None
        (packed,), _ = load(ctx)
        with no_autocast(g.device.type):
            if fused_backward(packed, ctx.dim):
                return _fused_backward(g, packed, ctx.y_dtype, ctx.x_dtype), None, None, None
            yh = decompress(packed, ctx.y_dtype)
            # each dequantized row rescaled to sum to 1, as the exact map does: then every row
            # of gx sums to 0 exactly (up to float rounding), so a bias added to every logit of
            # a row (a key bias, a talking-heads bias, a LayerNorm bias on k) keeps its exactly
            # zero stock gradient instead of collecting 8-bit rounding noise
            # (a row whose codes are all 0, possible for very long rows, stays 0: 0 / tiny)
            yh = yh / yh.sum(ctx.dim, keepdim=True).clamp_min(torch.finfo(yh.dtype).tiny)
            gx = torch._softmax_backward_data(g.to(ctx.y_dtype), yh, ctx.dim, ctx.y_dtype)
        return gx.to(ctx.x_dtype), None, None, None


class Softmax(MesaLayer, nn.Softmax):
    """``torch.nn.Softmax`` that saves only its output, 8-bit (dim 1 groups for 4-D tensors)."""

    # estimator="learned" keeps the running range [min, max] here: the few large
    # probabilities carry attention's gradient and are the tails a per-element objective
    # clips first, and the many small ones hold most of a row's mass, which a lower threshold
    # above 0 inflates. Either biases every step the same way: learned thresholds on the
    # softmax alone cost a 4-bit digits DeiT 24 points (top clipped), then 13.5 (bottom only)
    _learned_clipping = False

    def __init__(self, dim=None, *, device=None, **quant_options):
        super().__init__(dim=dim)
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Softmax, *, device=None, **quant_options) -> "Softmax":
        """See :func:`rebuild_parameter_free` for where the estimates go."""
        return rebuild_parameter_free(cls, stock, nn.Softmax, (stock.dim,), device, quant_options)

    def forward(self, input, *, with_copy: bool = False, out_dtype: Optional[torch.dtype] = None,
                dim: Optional[int] = None):
        """The output, or with ``with_copy=True`` :meth:`forward_with_copy`'s ``(output, copy)``.
        Callers that hand the copy on call the module this way rather than the method, so
        that module hooks see the call as this layer's (``SavedTensorMeter`` attributes the
        copy to the softmax, not to the attention calling it: ``describe`` reported a
        patched attention's int8 map as "left as is")."""
        y, copy = self.forward_with_copy(input, out_dtype, dim)
        return (y, copy) if with_copy else y

    def forward_with_copy(self, input, out_dtype: Optional[torch.dtype] = None, dim: Optional[int] = None
                          ) -> tuple[torch.Tensor, Optional[Packed]]:
        """``(output, its 8-bit copy)``; the copy is ``None`` when nothing was compressed
        (eval mode, disabled, or no gradient needed). ``out_dtype``: the output cast to it
        inside the layer, before the compression: the cast its consumer would make anyway
        (autocast's ``attn @ v``: :func:`autocast_dtype_for`), and the copy is of the map the
        consumer gets. The gradient then arrives in that dtype and backward is one op with no
        cast of the map around it (under CUDA autocast the softmax runs in float32: per block
        two passes over the float32 map saved in backward, one in forward). ``dim``: this
        call's softmax dim instead of the layer's (the generic attention routing's softmax
        over the tokens, CoaT's ``k.softmax(dim=2)``)."""
        if not self._mesa_active(input):
            y = super().forward(input) if dim is None else F.softmax(input, dim)
            return (y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)), None
        dim = self.dim if dim is None else dim
        if dim is None:
            dim = F._get_softmax_dim("softmax", input.dim(), 5)  # same implicit choice and warning
        dim = dim % input.dim() if input.dim() else 0
        quantizer = self.quantizer  # (read once: nn.Module.__getattr__ is a slow path)
        fused = quantizer.fused_layer_args(input)
        if fused is not None:  # eager, a channel format: the layer with a C++ autograd node
            y, q, alpha, beta = torch.ops.mesa.softmax_train(input, dim, *fused, out_dtype)
            packed = Packed(q, alpha, beta, group_dim_4d(y) % y.dim(), alpha.shape[1], quantizer.format_of(y))
            sharing.offer(y, packed)
            return y, packed
        y, q, alpha, beta = _SoftmaxFn.apply(input, dim, quantizer, out_dtype)
        return y, Packed(q, alpha, beta, group_dim_4d(y) % y.dim(), alpha.shape[1], quantizer.format_of(y))

    def extra_repr(self) -> str:
        return f"{nn.Softmax.extra_repr(self)}, {self._mesa_repr()}"

