"""Mesa ``MatMul``: ``forward(a, b) = a @ b`` exactly; operands kept 8-bit for backward.

Groups: per head (dim 1) for 4-D ``(B, H, N, M)`` operands, channel blocks of the last
dim otherwise.

``operands`` (default ``("a", "b")``) names the operands this layer quantizes itself
(one :class:`ActivationQuantizer` each: ``quantizer_a`` / ``quantizer_b``). For each
operand the backward needs, the layer keeps, in this order of preference:

1. a *shared* copy: when the operand is the output of a Mesa ``Softmax`` (``attn @ v``),
   the Softmax's own uint8 copy is reused through :mod:`mesa_train.nn.sharing`, so the map
   is stored once, in 8 bits (the stock ``attn @ v`` likewise shares the softmax's saved
   output). This applies whether or not the operand is in ``operands``; a quantizer whose
   operand was shared is not updated for that call;
2. its own uint8 copy, if the operand is in ``operands``;
3. otherwise the operand as the stock ``a @ b`` keeps it (full precision, in the dtype the
   product is computed in; a view into a bigger tensor, like ``v`` of the fused qkv
   output, is kept as a compact copy, as the stock batched matmul does).

So ``MatMul(operands=())`` compresses nothing itself: it is what ``patch_model`` puts at
``attn @ v`` when only ``softmax`` is requested (the map kept once, in 8 bits, ``v`` as
usual, the paper's Table 7 "Softmax" row). When no operand is compressed or shared in a
call, it simply runs the stock ``a @ b`` (stock gradients).

In eager training with a channel format, the paper's 8-bit one or a variant (and the
compiled extension), the whole layer runs as one op with a C++ autograd node,
``mesa::matmul_train`` (csrc/layers_autograd.cpp: the same kernels in the same order as
``_MatMulFn``, bitwise, tests/test_layers_autograd.py), which saves the Python
``autograd.Function`` host time; a shared copy's format goes with it (``format_code``). The
sharing decisions above stay here. Under ``torch.compile``, for patch4x4 codes and for
learned thresholds ``_MatMulFn`` runs.

After each compressed call ``last_saved`` records what was kept per operand
(``("shared" | "int8" | "full" | None, ...)``, ``None``: not needed for backward), which
:func:`mesa_train.patch.describe` reports.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from .first_order import first_order
from . import quantizer as quantizer_mod
from . import sharing
from ._common import (MesaLayer, autocast_casts, copy_estimates, group_dim_4d, inherit_options, load, no_autocast,
                      save, stock_device)
from .quantizer import Packed, decompress, format_code

__all__ = ["FULL_OPERANDS_ATTR", "MatMul", "OPERANDS"]

OPERANDS = ("a", "b")
# (in a MatMul's __dict__: the operands kept in full, as given (a view of the keeper's storage, not
# the product's compact copy), although the layer has a quantizer for them, because another module
# keeps those very tensors in full anyway: mesa_train.patch.duplicates.skip_duplicated. Not in
# state_dict: the quantizers' buffers stay.)
FULL_OPERANDS_ATTR = "_mesa_full_operands"


def _check_operands(operands) -> Tuple[str, ...]:
    if isinstance(operands, str):
        operands = (operands,) if operands else ()
    try:
        names = tuple(operands)
    except TypeError:
        raise ValueError(f"operands must be a subset of {OPERANDS}, got {operands!r}") from None
    bad = [o for o in names if o not in OPERANDS]
    if bad:
        raise ValueError(f"operands must be a subset of {OPERANDS}, got {operands!r}")
    return tuple(o for o in OPERANDS if o in names)


def _full_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The operand as the stock matmul keeps it: in the compute dtype (under autocast the
    stock op keeps its cast copy), and compact when ``t`` views a bigger storage. (Under
    ``torch.compile`` the partitioner decides what is saved: keep ``t`` itself.)"""
    if t.dtype != dtype:
        return t.to(dtype)
    if torch.compiler.is_compiling():
        return t
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.contiguous() if not t.is_contiguous() else t.clone()
    return t


def batched_operands(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` with the contiguous copy the stock batched ``a @ b`` would make of
    each made here instead, once, so that the product and the compression share it.

    ``torch.matmul`` of two operands with the same batch dims reshapes each to ``(batch, n,
    m)``, which copies an operand that is not viewable so (``q``, ``k``, ``v`` of timm's
    fused qkv: heads and batch are not one stride). The compression (or the compact copy
    kept for backward) then copied it a second time. Copying first hands the product the
    very tensor its reshape would have made, so the forward is bitwise unchanged, and the
    compression finds it contiguous. Operands the product would not copy (a plain
    transposed view, which the GEMM reads in place) are left as they are, and so are those
    autocast will cast first (the cast is the copy then). Under ``torch.compile`` too: the
    graph then holds one clone per operand, as the compiled stock graph does (before, Inductor
    wrote the product's copy and the compression's, one kernel writing both). C++ twin:
    ``batched_operands`` in csrc/layers_autograd.cpp."""
    if not _same_batch(a.shape, b.shape):
        return a, b
    return _as_batch_copy(a), _as_batch_copy(b)


def _same_batch(a_shape, b_shape) -> bool:
    return len(a_shape) >= 3 and len(b_shape) >= 3 and a_shape[:-2] == b_shape[:-2]


def _as_batch_copy(t: torch.Tensor) -> torch.Tensor:
    if autocast_casts(t):
        return t  # autocast's cast makes the copy
    return _batch_copy(t)


def _batch_copy(t: torch.Tensor) -> torch.Tensor:
    return t if _batch_dims_flatten(t) else t.contiguous()  # (reshape's copy is contiguous)


def _batch_dims_flatten(t: torch.Tensor) -> bool:
    """Whether ``t.reshape(-1, n, m)`` is a view: each batch dim (size > 1) steps over the
    next one exactly, ATen's view rule for merging dims. From sizes and strides only, so
    that it also holds while Dynamo traces."""
    if t.numel() == 0:
        return True
    dims = [(size, stride) for size, stride in zip(t.shape[:-2], t.stride()[:-2]) if size != 1]
    return all(outer[1] == inner[0] * inner[1] for outer, inner in zip(dims, dims[1:]))


class _MatMulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, shared_a: Optional[Packed], shared_b: Optional[Packed], quantizer_a, quantizer_b, record,
                addend=None, as_given=()):
        given = (a, b)
        a, b = batched_operands(a, b)  # before the product: its copies serve the compression too
        # autocast applies here, exactly like the stock `a @ b` (or `baddbmm(addend, a, b)`)
        out = torch.matmul(a, b) if addend is None else torch.baddbmm(addend, a, b)
        cdt = out.dtype
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        kept = []
        for t, shared, qz, needed, o, arg in ((a, shared_a, quantizer_a, need_b, "a", given[0]),
                                              (b, shared_b, quantizer_b, need_a, "b", given[1])):
            if not needed:  # the gradient of a needs b and vice versa
                kept.append((None, None, None))
            elif shared is not None:
                kept.append((shared, None, "shared"))
            elif qz is not None:
                kept.append((qz.compress(t, group_dim_4d(t)), None, "int8"))
            elif o in as_given and arg.dtype == cdt and not torch.compiler.is_compiling():
                # another module keeps this very tensor: a view of its storage adds no bytes, where
                # the compact copy the product made (a strided view's) would (FULL_OPERANDS_ATTR).
                # Eager only: a traced Function rebuilds a saved input from its base, so an in-place
                # change after the product reached the compiled backward silently (the review's
                # find; torch 2.14, also for a plain Function); what a compiled step keeps is the
                # partitioner's choice anyway
                kept.append((None, arg, "full"))
            else:
                kept.append((None, _full_copy(t, cdt), "full"))
        (pa, ra, ka), (pb, rb, kb) = kept
        record[:] = [ka, kb]
        ctx.cdt, ctx.a_dtype, ctx.b_dtype = cdt, a.dtype, b.dtype
        ctx.a_shape, ctx.b_shape = a.shape, b.shape
        ctx.addend_shape = ctx.addend_dtype = None
        if addend is not None:
            ctx.addend_shape, ctx.addend_dtype = addend.shape, addend.dtype
        save(ctx, [pa, pb], ra, rb)
        return out

    @staticmethod
    @first_order
    def backward(ctx, g):
        (pa, pb), (ra, rb) = load(ctx)
        ga = gb = gc = None
        a_shape, b_shape = ctx.a_shape, ctx.b_shape
        cdt = ctx.cdt
        with no_autocast(g.device.type):
            g = g.to(cdt)
            # g feeds up to two products: one copy, as the stock backward makes. (Not under
            # torch.compile: reading g's strides there made the traced backward run in float32
            # under autocast, a cast before and after every op; the compiler lays g out itself.)
            if _same_batch(a_shape, b_shape) and not torch.compiler.is_compiling():
                g = _batch_copy(g)
            if len(a_shape) == 1 and len(b_shape) == 1:
                g = g.reshape(1, 1)  # (a dot product: g is 0-dim, the review's find)
            elif len(a_shape) == 1:
                g = g.unsqueeze(-2)
            elif len(b_shape) == 1:
                g = g.unsqueeze(-1)
            if ctx.needs_input_grad[0]:
                bh = decompress(pb, cdt) if pb is not None else rb.to(cdt)
                bh = bh.unsqueeze(-1) if len(b_shape) == 1 else bh
                ga = g.matmul(bh.transpose(-1, -2))
                a2 = (1,) + tuple(a_shape) if len(a_shape) == 1 else tuple(a_shape)
                ga = ga.sum_to_size(a2).reshape(a_shape).to(ctx.a_dtype)
            if ctx.needs_input_grad[1]:
                ah = decompress(pa, cdt) if pa is not None else ra.to(cdt)
                ah = ah.unsqueeze(0) if len(a_shape) == 1 else ah
                gb = ah.transpose(-1, -2).matmul(g)
                b2 = tuple(b_shape) + (1,) if len(b_shape) == 1 else tuple(b_shape)
                gb = gb.sum_to_size(b2).reshape(b_shape).to(ctx.b_dtype)
            if ctx.needs_input_grad[7]:  # (a learned bias added by baddbmm: broadcast over the batch or rows)
                gc = g.sum_to_size(ctx.addend_shape).to(ctx.addend_dtype)
        return ga, gb, None, None, None, None, None, gc, None


def _take_shared(layer: "MatMul", t: torch.Tensor, quantizer) -> Optional[Packed]:
    dim = group_dim_4d(t)
    if quantizer is not None:
        groups = quantizer.effective_groups(t, dim % t.dim())
    else:
        groups = max(1, min(layer.quant_options.num_groups, t.shape[dim]))
    return sharing.take(t, dim, groups)


# (arguments of mesa::matmul_train for an operand with no shared copy / no quantizer)
_NO_SHARED = ([], 0, 0)
_NO_QUANTIZER = ([], 0, 0.0, False, False, False)


def _fused_args(shared: Optional[Packed], quantizer, t: torch.Tensor):
    """``(args, shared_format)``: the ``mesa::matmul_train`` arguments of one operand (its
    shared copy, its quantizer) and the shared copy's ``format_code``, or ``None`` when the
    Python Function must run (under compile, no extension, a format the op does not take:
    see ``ActivationQuantizer.fused_layer_args``; a shared copy not of ``t``'s shape)."""
    if not quantizer_mod.fused_layers_on():
        return None
    if shared is None:
        s, fmt = _NO_SHARED, 0
    elif shared.fmt is None or (shared.fmt[0] == "bits" and tuple(shared.fmt[3]) == tuple(t.shape)):
        s, fmt = ([shared.q, shared.alpha, shared.beta], shared.dim, shared.num_groups), format_code(shared.fmt)
    else:
        return None
    if quantizer is None:
        return s + _NO_QUANTIZER, fmt
    fused = quantizer.fused_state_args(t)
    return None if fused is None else (s + fused, fmt)


def _kind(shared, quantizer, needed: bool) -> str | None:
    return None if not needed else "shared" if shared is not None else "int8" if quantizer is not None else "full"


def _kinds(a, b, sa, sb, qa, qb) -> tuple:
    """What each operand keeps (``last_saved``), as ``_MatMulFn`` records it (a pair, not a
    generator: this runs at every eager call)."""
    return _kind(sa, qa, b.requires_grad), _kind(sb, qb, a.requires_grad)


def _compressed_matmul(layer: "MatMul", a, b, shared_a: Optional[Packed] = None, addend=None):
    qa = getattr(layer, "quantizer_a", None)
    qb = getattr(layer, "quantizer_b", None)
    full = layer.__dict__.get(FULL_OPERANDS_ATTR) or ()
    if full:  # (another module keeps them in full: a reference to its tensor adds no bytes)
        qa, qb = (None if "a" in full else qa), (None if "b" in full else qb)
    sa = shared_a if shared_a is not None else (_take_shared(layer, a, qa) if a.dim() else None)
    sb = _take_shared(layer, b, qb) if b.dim() else None
    if qa is None and qb is None and sa is None and sb is None:
        layer.last_saved = ("full", "full")
        return _stock(a, b, addend)  # nothing to compress or share: the stock op
    # (mesa::matmul_train adds nothing, and keeps a full operand as the product's compact copy)
    fa = _fused_args(sa, qa, a) if addend is None and not full else None
    fb = _fused_args(sb, qb, b) if fa is not None else None
    if fb is not None:  # eager, a channel format: the layer with a C++ autograd node (csrc/layers_autograd.cpp)
        (fa, fmt_a), (fb, fmt_b) = fa, fb
        out = torch.ops.mesa.matmul_train(a, b, *fa[:3], *fb[:3], *fa[3:], *fb[3:], fmt_a, fmt_b)
        layer.last_saved = _kinds(a, b, sa, sb, qa, qb)
        return out
    record: list = []
    out = _MatMulFn.apply(a, b, sa, sb, qa, qb, record, addend, full)
    layer.last_saved = tuple(record) if record else None
    return out


def _stock(a, b, addend):
    return torch.matmul(a, b) if addend is None else torch.baddbmm(addend, a, b)


class MatMul(MesaLayer, nn.Module):
    """``a @ b`` as a module that keeps the operands named in ``operands`` 8-bit
    (buffers under ``quantizer_a`` / ``quantizer_b``) and reuses a producer's shared 8-bit
    copy of either operand (see the module doc)."""

    _quantizer_names = ("quantizer_a", "quantizer_b")

    def __init__(self, *, operands=OPERANDS, device=None, **quant_options):
        super().__init__()
        self.operands = _check_operands(operands)
        self._quantizer_names = tuple(f"quantizer_{o}" for o in self.operands)
        self.last_saved: Optional[tuple] = None
        self._init_mesa(quant_options, device)

    @classmethod
    def from_module(cls, stock: nn.Module | None = None, *, operands=None, device=None,
                    **quant_options) -> "MatMul":
        """A Mesa MatMul; ``stock`` may be ``None``, a stock ``a @ b`` module or another
        ``MatMul`` (options, ``operands`` unless given, and matching estimates kept).
        ``device``: where the estimates go (default: ``stock``'s buffers' device, else CPU)."""
        if operands is None:
            operands = stock.operands if isinstance(stock, MatMul) else OPERANDS
        new = cls(operands=operands, device="meta", **inherit_options(stock, quant_options))
        dev = stock_device(stock, device) if isinstance(stock, nn.Module) else torch.device(device or "cpu")
        copy_estimates(stock, new, dev)
        return new.train(stock.training) if isinstance(stock, nn.Module) else new

    def forward(self, a, b, shared_a: Optional[Packed] = None, addend: Optional[torch.Tensor] = None):
        """``a @ b``; ``shared_a``: an 8-bit copy of ``a`` its producer already keeps (see
        :meth:`mesa_train.nn.Softmax.forward_with_copy`), kept instead of quantizing ``a``;
        ``addend``: ``torch.baddbmm(addend, a, b)`` instead, for 3-D operands (the masked
        scores of ``nn.MultiheadAttention``'s explicit path: the stock op's bits, as adding
        the mask after the product would not be)."""
        if not self._mesa_active(a, b):
            return _stock(a, b, addend)
        return _compressed_matmul(self, a, b, shared_a, addend)

    def extra_repr(self) -> str:
        ops = "" if self.operands == OPERANDS else f"operands={self.operands}, "
        return ops + self._mesa_repr()
