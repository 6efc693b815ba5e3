"""Shared pieces of the Mesa layers: the layer mixin and autograd helpers.

Every layer's custom ``autograd.Function`` keeps *everything* it needs for backward through
``ctx.save_for_backward`` (so saved-tensor hooks, activation checkpointing and
:class:`mesa_train.memory.SavedTensorMeter` see it), via :func:`save` / :func:`load`.
Backward runs with autocast disabled and computes in the dtype the forward computed in,
casting each gradient to the dtype of the input it belongs to (what autograd expects, and
what the stock ``ToCopyBackward`` of autocast would produce).
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import nn

from .quantizer import REUSE_FLAG, REUSE_KEY, ActivationQuantizer, Packed, QuantOptions, decompress
from .tracing import refuse_fx_proxy, refuse_script

__all__ = ["MesaLayer", "save", "load", "no_autocast", "group_dim_4d", "grad_to", "is_channels_last", "nhwc_view",
           "from_nhwc", "active_with_params"]


# ----------------------------------------------------------------------------- autograd
def save(ctx, packs: Sequence[Packed | None], *extra: torch.Tensor | None) -> None:
    """``ctx.save_for_backward`` the tensors of ``packs`` (None allowed) and ``extra``."""
    tensors: list = []
    meta: list = []
    for p in packs:
        if p is None:
            meta.append(None)
        else:
            meta.append((p.dim, p.num_groups, p.fmt))
            tensors.extend((p.q, p.alpha, p.beta))
    ctx.mesa_meta = meta
    ctx.save_for_backward(*tensors, *extra)


def load(ctx) -> tuple[list[Packed | None], list[torch.Tensor | None]]:
    saved = ctx.saved_tensors
    packs: list[Packed | None] = []
    i = 0
    for m in ctx.mesa_meta:
        if m is None:
            packs.append(None)
        else:
            packs.append(Packed(saved[i], saved[i + 1], saved[i + 2], m[0], m[1], m[2]))
            i += 3
    return packs, list(saved[i:])


def no_autocast(device_type: str):
    """Disable autocast for the device (backward computes in explicit dtypes)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return contextlib.nullcontext()  # the common case (backward): skip building a context
        return torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:  # a device type autocast does not know
        return contextlib.nullcontext()


def grad_to(g: torch.Tensor | None, like: torch.Tensor | None):
    if g is None or like is None:
        return g
    return g if g.dtype == like.dtype else g.to(like.dtype)


# the device types with an autocast mode, found once (torch.amp.is_autocast_available is a
# builtin that Dynamo of torch 2.11 cannot trace; a set lookup traces as a constant)
_AUTOCAST_DEVICES = frozenset(d for d in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "privateuseone")
                              if torch.amp.is_autocast_available(d))


def autocast_casts(x: torch.Tensor) -> bool:
    """Whether autocast casts ``x`` before a matmul / linear: a floating ``x`` other than
    float64 and the autocast dtype of its device, autocast on (csrc/layers_common.h twin)."""
    dev = x.device.type
    return (x.is_floating_point() and x.dtype != torch.float64 and dev in _AUTOCAST_DEVICES
            and torch.is_autocast_enabled(dev) and x.dtype != torch.get_autocast_dtype(dev))


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as autocast casts a matmul's input, else ``x``: the tensor stock's ``F.linear``
    multiplies and its backward keeps, so the one to compress (DESIGN.md, "Linear under
    autocast"; the cast is made once, before ``F.linear`` instead of inside it)."""
    return x.to(torch.get_autocast_dtype(x.device.type)) if autocast_casts(x) else x


def device_type(x: torch.Tensor) -> str:
    """``x.device.type``, without building a ``torch.device`` for the two common cases (0.1 us
    against 0.65 us a call on CPU: a per-layer cost in eager)."""
    return "cuda" if x.is_cuda else "cpu" if x.is_cpu else x.device.type


def autocast_state(device_type: str):
    """``(enabled, dtype)`` of autocast on ``device_type`` now (a backward that recomputes
    re-enters it)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # very old torch
        enabled = torch.is_autocast_enabled()
    dtype = torch.get_autocast_dtype(device_type) if enabled else None
    return enabled, dtype


def group_dim_4d(x: torch.Tensor) -> int:
    """Per-head groups (dim 1) for 4-D ``(B, H, N, M)`` tensors, channel groups (-1) otherwise."""
    return 1 if x.dim() == 4 else x.dim() - 1


def is_channels_last(x: torch.Tensor) -> bool:
    """A 4-D tensor laid out NHWC (channels-last), not also plain contiguous."""
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def nhwc_view(x: torch.Tensor, dim: int, channel_layout: bool) -> tuple[torch.Tensor, int, bool]:
    """``(x or its NHWC view, the group dim in it, whether it is the view)``: a channels-last
    4-D ``x`` grouped over dim 1 is compressed as ``x.permute(0, 2, 3, 1)`` grouped over its
    last dim (the same groups and statistics, the codes in x's own order): no copy to NCHW,
    and :func:`from_nhwc` hands backward a channels-last tensor again, so the gradients keep
    stock's layout (DESIGN.md, "Channels-last inputs"). Formats with channel groups only
    (``QuantOptions.channel_layout``, any bits: patch4x4 blocks are NCHW planes). C++ twin:
    ``nhwc_view`` in csrc/layers_common.h."""
    if channel_layout and dim == 1 and is_channels_last(x):
        return x.permute(0, 2, 3, 1), 3, True
    return x, dim, False


def save_elementwise_input(ctx, x: torch.Tensor, y: torch.Tensor, quantizer, *extra: torch.Tensor) -> None:
    """What an elementwise activation's Function keeps of ``y = f(x)``: ``x`` compressed by
    ``quantizer`` (per-head groups for a 4-D attention map, channel groups otherwise; a
    channels-last ``x`` through its NHWC view), and ``extra``. Sets ``ctx.nhwc``, ``ctx.cdt``
    (``y``'s dtype, which backward computes in) and ``ctx.x_dtype`` (its gradient's)."""
    xv, dim, ctx.nhwc = nhwc_view(x, group_dim_4d(x), quantizer.options.channel_layout)
    ctx.cdt, ctx.x_dtype = y.dtype, x.dtype
    save(ctx, [quantizer.compress(xv, dim)], *extra)


def kept_input(ctx, packed: Packed) -> torch.Tensor:
    """What :func:`save_elementwise_input` compressed, dequantized in ``ctx.cdt`` and in the
    input's layout (NCHW order, a channels-last view where it was channels last)."""
    return from_nhwc(decompress(packed, ctx.cdt), ctx.nhwc)


def to_nhwc(g: torch.Tensor, permuted: bool) -> torch.Tensor:
    """A gradient of the NCHW tensor in the layout of its NHWC codes (a view; from_nhwc's inverse)."""
    return g.permute(0, 2, 3, 1) if permuted else g


def from_nhwc(xh: torch.Tensor, permuted: bool) -> torch.Tensor:
    """What :func:`nhwc_view` compressed, back in NCHW order (a channels-last view, no copy)."""
    return xh.permute(0, 3, 1, 2) if permuted else xh


def active_with_params(layer, x: torch.Tensor) -> bool:
    """``layer._mesa_active(x, layer.weight, layer.bias)``, reading the parameters only when
    ``x`` needs no gradient (in training it almost always does): each read is a
    ``nn.Module.__getattr__``, a slow path, and the fused pairs' checks ask this of two layers
    a call (``can_fuse_norm``, ``can_fuse``)."""
    return layer._mesa_active(x) or layer._mesa_active(x, layer.weight, layer.bias)


# ----------------------------------------------------------------------------- layer mixin
# set on every module of a model given to patch.reuse.keep_running_ranges: its reused layers keep
# one running range (a checkpoint's reuse switch is not taken either)
KEEP_RUNNING_RANGES = "_mesa_keep_running_ranges"


class MesaLayer:
    """Mixin for the Mesa layers: options, quantizers, repr, train/eval dispatch."""

    _quantizer_names: tuple[str, ...] = ("quantizer",)
    # estimator="learned": may the quantizers clip at learned thresholds (False: Softmax)
    _learned_clipping: bool = True
    # layouts a layer accepts (QuantOptions.layout): patch4x4 needs (B, C, H, W) activations
    _layouts: tuple[str, ...] = ("channel",)

    def _check_layout(self, opts: QuantOptions) -> None:
        if opts.layout not in self._layouts:
            raise ValueError(
                f"layout={opts.layout!r} is not supported by {type(self).__name__} (its saved activation is not a "
                f"conv feature map (B, C, H, W)); valid layouts here: {list(self._layouts)} "
                f"(layout='patch4x4' applies to ops=['conv'] only)")

    def _init_mesa(self, quant_options: dict, device=None) -> None:
        opts = quant_options.pop("options", None)
        if opts is None:
            opts = QuantOptions.from_kwargs(**quant_options)
        elif quant_options:
            opts = opts.replace(**quant_options)
        if not isinstance(opts, QuantOptions):
            raise ValueError(f"options must be a QuantOptions, got {type(opts).__name__}")
        self._check_layout(opts)
        self._mesa_options = opts.interned()  # (same_options: an identity check under compile)
        for name in self._quantizer_names:
            setattr(self, name, self._new_quantizer(opts, device))

    @property
    def quant_options(self) -> QuantOptions:
        return self._mesa_options

    def set_quant_options(self, **kwargs) -> None:
        """Change quantization options on this layer (and its quantizers)."""
        new = self._mesa_options.replace(**kwargs)
        self._check_layout(new)
        self._mesa_options = new.interned()
        for name in self._quantizer_names:
            getattr(self, name).set_options(**kwargs)

    def quantizers(self) -> list[ActivationQuantizer]:
        return [getattr(self, n) for n in self._quantizer_names]

    def switch_to_per_sample_for_reuse(self) -> None:
        """``estimator="per_sample"``, marked as the reuse check's switch (patch/reuse.py): the
        quantizers' ``state_dict`` metadata says so, and a layer loading it switches too."""
        self.set_quant_options(estimator="per_sample")
        for q in self.quantizers():
            q.__dict__[REUSE_FLAG] = True

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        meta = getattr(destination, "_metadata", None)  # (state_dict() made this module's dict there)
        if meta is not None and self._mesa_options.estimator == "per_sample" and any(
                q.__dict__.get(REUSE_FLAG) for q in self.quantizers()):
            meta.setdefault(prefix[:-1], {})[REUSE_KEY] = True

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        # a checkpoint of a layer the reuse check switched (its state_dict metadata): switch
        # this one too, unless its model keeps running ranges (keep_running_ranges) or it was
        # patched with another estimator
        if ((local_metadata or {}).get(REUSE_KEY) and self._mesa_options.estimator in ("running", "delayed")
                and not self.__dict__.get(KEEP_RUNNING_RANGES)):
            self.switch_to_per_sample_for_reuse()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    def _mesa_active(self, *tensors) -> bool:
        """True when this call must compress (training, enabled, a gradient is needed, and no
        tensor is empty: an empty batch, as a detection head without RoIs or an expert without
        tokens gets, or a Linear with no outputs has nothing to keep, and the norms' grouped
        statistics cannot be taken of it). Every Mesa layer asks this at every call: one pass
        over ``tensors`` does the gradient test, the emptiness test and the torch.fx guard."""
        grad, empty = False, False
        for t in tensors:
            if isinstance(t, torch.Tensor):
                grad = grad or t.requires_grad
                empty = empty or t.numel() == 0
            elif isinstance(t, torch.fx.Proxy):
                refuse_fx_proxy(self, (t,))  # never a silently stock torch.fx graph (nn/tracing.py)
        return grad and not empty and self.training and self._mesa_options.enabled and torch.is_grad_enabled()

    def __prepare_scriptable__(self):  # torch.jit.script: a clear error (nn/tracing.py)
        refuse_script(self)

    def _mesa_repr(self) -> str:
        return f"mesa({self._mesa_options})"

    def _rebind_quantizers(self, device) -> None:
        for name in self._quantizer_names:
            setattr(self, name, self._new_quantizer(self._mesa_options, device))

    def _new_quantizer(self, options: QuantOptions, device) -> ActivationQuantizer:
        """One of this layer's quantizers (the layer decides whether learned thresholds clip)."""
        return ActivationQuantizer(options, device=device, clippable=self._learned_clipping)


def stock_device(module: nn.Module, device=None) -> torch.device:
    """Where ``from_module`` puts the new layer's estimates: ``device`` when given, else
    the device of ``module``'s parameters or buffers (a Mesa layer's estimates included),
    else CPU. A stock ``GELU``/``ReLU``/``Softmax`` has neither, so the patcher passes the
    device of the module that holds it; the quantizers still follow their first input's
    device (``ActivationQuantizer.statistics``) as a safety net."""
    if device is not None:
        return torch.device(device)
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


class DropActChildren:
    """A Mesa norm followed by its own ``drop`` and ``act`` children, as timm's norm-act layers
    (``BatchNormAct2d``, ``LayerNormAct2d``; ``_timm_name`` names the one converted): the
    children are the stock module's own objects, which ``patch_model`` converts after it.
    Put before the Mesa norm in the bases: ``forward`` and ``from_module`` wrap the norm's."""

    _timm_name = ""

    def _set_drop_act(self, drop, act) -> None:
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.Identity()

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options):
        import timm.layers

        check_stock(stock, (getattr(timm.layers, cls._timm_name), cls))
        new = super().from_module(stock, device=device, **quant_options)
        new.drop, new.act = stock.drop, stock.act
        return new

    def forward(self, input):
        return self.act(self.drop(super().forward(input)))


def check_stock(stock: nn.Module, base) -> None:
    """``base``: a class or a tuple of them (the first one is named in the error)."""
    if not isinstance(stock, base):
        first = base[0] if isinstance(base, tuple) else base
        raise TypeError(f"expected an instance of {first.__module__}.{first.__name__}, got {type(stock).__name__}")


def inherit_options(stock: nn.Module, quant_options: dict) -> dict:
    """Options for ``from_module``: a Mesa ``stock`` keeps its own, overridden by ``quant_options``."""
    if isinstance(stock, MesaLayer):
        return {**stock.quant_options.as_dict(), **quant_options}
    return dict(quant_options)


def copy_estimates(stock: nn.Module, new: "MesaLayer", device) -> None:
    """Give ``new`` quantizers on ``device``; copy estimates from a Mesa ``stock`` when they fit."""
    new._rebind_quantizers(device)
    if isinstance(stock, MesaLayer):
        for name in new._quantizer_names:
            old = getattr(stock, name, None)
            q = getattr(new, name)
            if isinstance(old, ActivationQuantizer) and old.alpha.shape == q.alpha.shape:
                with torch.no_grad():
                    q.alpha.copy_(old.alpha)
                    q.beta.copy_(old.beta)
                    q.initialized.copy_(old.initialized)


def adopt_parameters(stock: nn.Module, new: "MesaLayer", device=None):
    """Finish ``from_module`` of a layer with ``weight``/``bias``: share the stock module's
    parameter objects (no copy: optimizers and tied weights keep working) and place the
    estimates beside them (``device`` only matters when there are none, e.g. a LayerNorm
    without affine)."""
    new.weight = stock.weight
    new.bias = stock.bias
    copy_estimates(stock, new, stock.weight.device if stock.weight is not None else stock_device(stock, device))
    return new.train(stock.training)


def rebuild_parameter_free(cls, stock: nn.Module, base: type, ctor_args: tuple, device, quant_options: dict):
    """``from_module`` of a layer without parameters (GELU, Softmax): build it on meta, then
    give it estimates on ``device`` (a stock module of this kind has no parameters to tell
    where; ``patch_model`` passes the device of the module holding it). Default: the device
    of ``stock``'s buffers (a Mesa ``stock``), else CPU; the estimates move to the input's
    device on the first compressed call anyway."""
    check_stock(stock, base)
    new = cls(*ctor_args, device="meta", **inherit_options(stock, quant_options))
    copy_estimates(stock, new, stock_device(stock, device))
    return new.train(stock.training)
