"""Mesa EvoNorm (timm's ``EvoNorm2dB0/B1/B2`` and ``EvoNorm2dS0/S0a/S1/S1a/S2/S2a``) and Filter
Response Normalization (``FilterResponseNormTlu2d``, ``FilterResponseNormAct2d``): the forward is
the stock one, call for call (the same bits); the input ``x`` is kept in 8 bits, one group per
channel, and backward re-runs the layer's own forward on the dequantized input and takes
autograd's derivative of it.

Stock autograd keeps several full-precision tensors of ``x``'s size per layer: ``x``, the gate
``sigmoid(v x)`` or the activation's input, the group or instance statistic expanded to ``x``'s
shape, the quotient before the affine map (the census of session 78: ``resnetv2_50d_evos``
0.84-0.86x and ``resnetv2_50d_frn`` 0.79x of stock's bytes with everything else compressed).

Why re-run instead of a formula per layer: the eleven variants are different compositions of an
activation, a group / instance / batch statistic, a max and a quotient; one derivative written by
autograd from the stock code cannot drift from it. The cost is one more forward of the layer per
step (element-wise ops and reductions). The gradient is evaluated at the dequantized input, as
GELU's is, and so are the statistics inside it (a group's std from 8-bit values: a relative error
of about one rounding step over ``sqrt(12 N)`` standard deviations, N the group's size).

What happens once: the forward runs in the autograd Function's forward only. The re-run in
backward reads what the forward read (the tensors given to the Function: under
``torch.func.functional_call`` the caller's, a parametrization's ``original``), computes on
scratch copies of the buffers (the B variants' training forward updates ``running_var``), in
train mode, under the forward's autocast state, and calls no hook. Like ``functional_call``, it
puts these in the module's place while it runs: a forward of the same module in another thread
at that moment would see them. ``S1``/``S2``'s ``act`` (SiLU by default)
is applied to ``x`` inside the layer: it runs stock in both runs (``patch_model`` leaves it
unconverted). ``FilterResponseNormAct2d``'s ``act`` is applied to the layer's output: it stays a
child of its own, converted like any activation (its input is this layer's output, not ``x``).
An ``act`` inside that draws random numbers (``nn.RReLU``) would draw again in the re-run: none
of timm's EvoNorm configurations uses one; the inside ``act``'s hooks run again in the re-run (as
part of the function: a hook may change its output). A layer whose weight a forward pre-hook
computes (``prune``, the hook-based ``weight_norm``) runs stock. Higher-order gradients
(``create_graph=True``) are refused with one line, as the other Mesa layers refuse them.

Under ``torch.compile`` these layers run stock, traced into the graph: Dynamo does not trace the
backward's ``torch.autograd.grad`` (``trace_autograd_ops`` is off), and the graph break at every
norm (23 in ``regnetz_b16_evos``) made each later frame recompile until Dynamo's limit.
"""
from __future__ import annotations

import contextlib

import torch
from timm.layers import evo_norm as _evo
from timm.layers import filter_response_norm as _frn
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module  # (torch.func.functional_call's substitution)

from .first_order import refuse_higher_order
from ._common import MesaLayer, autocast_state, copy_estimates, inherit_options, kept_input, load, no_autocast
from ._common import save_elementwise_input, stock_device
from .relu import pack_bits, unpack_bits

__all__ = ["EvoNorm2dB0", "EvoNorm2dB1", "EvoNorm2dB2", "EvoNorm2dS0", "EvoNorm2dS0a", "EvoNorm2dS1", "EvoNorm2dS1a",
           "EvoNorm2dS2", "EvoNorm2dS2a", "FilterResponseNormTlu2d", "FilterResponseNormAct2d",
           "EVO_NORM_CLASSES", "STOCK_ACT_INSIDE", "acts_inside"]


@contextlib.contextmanager
def _rerun_state(layer: nn.Module, tensors: dict):
    """The layer as its forward saw it, for the backward's re-run: the tensors that forward read
    (``layer._rerun_inputs``: under ``torch.func.functional_call`` or a parametrization, not the
    module's own parameters) in their places, its buffers replaced by scratch copies (the B
    variants' ``running_var.copy_``: the forward's update stays the only one) and train mode
    (the re-run follows the forward's branch even after ``model.eval()``). Through torch's own
    substitution (``torch.func.functional_call``'s), without calling the module: its hooks do
    not fire again. An inside ``act`` is called as the forward called it, hooks included (a hook
    that changes its output, or prune's that computes its weight, is part of the function)."""
    scratch = {n: b.clone() for n, b in layer.named_buffers()  # (not the quantizers': the re-run leaves them)
               if not any(part.startswith("quantizer") for part in n.split("."))}
    training = layer.training
    try:
        layer.training = True
        with _reparametrize_module(layer, {**tensors, **scratch}):
            yield
    finally:
        layer.training = training


class _RerunFn(torch.autograd.Function):
    """``y = layer's forward(x)`` keeping 8-bit ``x`` (and what ``layer._forward_keeping`` adds,
    e.g. a side mask); backward differentiates ``layer._rerun`` at the dequantized input
    (module doc). ``names`` / ``tensors``: what the forward read besides ``x``
    (``layer._rerun_inputs``); their gradients come back in that order."""

    @staticmethod
    def forward(ctx, x, layer, quantizer, names, *tensors):
        y, kept, ctx.info = layer._forward_keeping(x)
        ctx.layer, ctx.names, ctx.n_kept = layer, names, len(kept)
        device_type = x.device.type
        ctx.autocast = (device_type,) + autocast_state(device_type)
        save_elementwise_input(ctx, x, y, quantizer, *kept, *tensors)
        return y

    @staticmethod
    def backward(ctx, g):
        # (not once_differentiable: that refuses only a g that requires grad, and a gradient
        # penalty through this layer lost its second-order term without a word; nn/first_order.py)
        if torch.is_grad_enabled():  # (first_order's check, with the layer's own name)
            refuse_higher_order(type(ctx.layer).__name__)
        (packed,), rest = load(ctx)
        kept, tensors = rest[:ctx.n_kept], rest[ctx.n_kept:]
        layer, need = ctx.layer, ctx.needs_input_grad
        device_type, enabled, dtype = ctx.autocast
        leaves = [t.detach().requires_grad_(n) for t, n in zip(tensors, need[4:])]
        with torch.enable_grad(), _rerun_state(layer, dict(zip(ctx.names, leaves))):
            with no_autocast(device_type), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                xr = kept_input(ctx, packed).to(ctx.x_dtype).detach().requires_grad_(True)
                y = layer._rerun(xr, kept, ctx.info)
            wanted = [xr] + [t for t, n in zip(leaves, need[4:]) if n]
            # (allow_unused: a tensor the forward read on a branch it did not take this time)
            grads = list(torch.autograd.grad(y, wanted, g, allow_unused=True))
        gx = grads.pop(0)
        gtensors = [grads.pop(0) if n else None for n in need[4:]]
        return (gx if need[0] else None, None, None, None, *gtensors)


class _EvoNormLayer(MesaLayer):
    """The Mesa twin of one timm EvoNorm / FRN class (``_stock``): the same parameters, buffers,
    children and ``state_dict`` keys, plus ``quantizer``. Built by ``from_module`` around the
    stock module's own objects (its parameters are shared, not copied)."""

    _stock: type = nn.Module

    @classmethod
    def from_module(cls, stock: nn.Module, *, device=None, **quant_options):
        # (a subclass with its own forward computes something else: refused, not converted wrongly)
        if not isinstance(stock, cls._stock) or type(stock).forward not in (cls._stock.forward, cls.forward):
            raise TypeError(f"expected an instance of {cls._stock.__module__}.{cls._stock.__name__}, "
                            f"got {type(stock).__name__}")
        channels = stock.weight.shape[0]
        options = {"num_groups": channels, **inherit_options(stock, quant_options)}  # (per channel: a norm)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for key, value in vars(stock).items():  # timm's attributes (eps, groups, apply_act, ...), not torch's
            if not key.startswith("_"):
                object.__setattr__(new, key, value)
        new._parameters.update(stock._parameters)
        new._buffers.update(stock._buffers)
        new._non_persistent_buffers_set = set(stock._non_persistent_buffers_set)
        new._modules.update({k: v for k, v in stock._modules.items() if k != "quantizer"})
        new._init_mesa(options, "meta")
        copy_estimates(stock, new, stock.weight.device if stock.weight is not None else stock_device(stock, device))
        return new.train(stock.training)

    def _stock_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._stock.forward(self, x)

    def _forward_keeping(self, x: torch.Tensor) -> tuple:
        """``(y, tensors backward needs besides the 8-bit x, anything else it needs)``: the stock
        forward, nothing more."""
        return self._stock_forward(x), (), None

    def _rerun(self, x: torch.Tensor, kept, info) -> torch.Tensor:
        """The forward backward differentiates, at the dequantized ``x``."""
        return self._stock_forward(x)

    def _rerun_inputs(self) -> tuple:
        """``(names, tensors)`` the forward reads besides ``x``, as it reads them now: the weight,
        bias, ``v`` / ``tau`` (a parametrized one's original; under ``torch.func.functional_call``
        the tensors given there), and the parameters of an ``act`` child applied inside the norm
        (S1/S2: a PReLU's weight)."""
        # (named_parameters: under functional_call the tensors given there; a parametrized weight
        # as its ``parametrizations.weight.original``, which the re-run maps again)
        inside = isinstance(self, STOCK_ACT_INSIDE)
        # (remove_duplicate=False: a tensor under two names, tied or given twice, is read twice)
        items = [(n, p) for n, p in self.named_parameters(remove_duplicate=False)
                 if not n.startswith("quantizer.") and (inside or not n.startswith("act."))]
        return tuple(n for n, _ in items), [p for _, p in items]

    def _compresses(self, x: torch.Tensor, tensors: list) -> bool:
        # Stock instead: under torch.compile (Dynamo does not trace the backward's autograd.grad,
        # and a graph break at every norm cost more than the bytes); with a weight a forward
        # pre-hook computes into a plain tensor (prune, the hook-based weight_norm and
        # spectral_norm, from weight_orig: the re-run, which substitutes weight_orig, would read
        # the stale one). Module doc.
        if x.dim() != 4 or torch.compiler.is_compiling() or not self._mesa_active(x, *tensors):
            return False
        return not any(isinstance(self.__dict__.get(n), torch.Tensor) for n in ("weight", "bias", "v", "tau"))

    def _after(self, y: torch.Tensor) -> torch.Tensor:
        """What the forward applies to the Function's output outside it (FRN-Act: its act)."""
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        names, tensors = self._rerun_inputs()
        if not self._compresses(x, tensors):
            return self._stock.forward(self, x)
        return self._after(_RerunFn.apply(x, self, self.quantizer, names, *tensors))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, {self._mesa_repr()}"


def _twin(stock: type, base: type = None, kept: str = "its 8-bit input") -> type:
    """``Mesa<stock>``: a subclass of ``base`` (``_EvoNormLayer`` or one of its own) and of
    ``stock`` (isinstance checks and the attributes of timm's class keep working), named after it."""
    return type(stock.__name__, (base or _EvoNormLayer, stock),
                {"_stock": stock, "__module__": __name__,
                 "__doc__": f"timm's ``{stock.__name__}`` keeping {kept} (module doc)."})


def _frn_affine(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's FRN forwards (TLU's, Act's) up to their last line, op for op: ``x`` over its
    instance RMS, then the affine map."""
    x_dtype = x.dtype
    v_shape = (1, -1, 1, 1)
    x = x * _frn.inv_instance_rms(x, layer.eps)
    return x * layer.weight.view(v_shape).to(dtype=x_dtype) + layer.bias.view(v_shape).to(dtype=x_dtype)


class _TluLayer(_EvoNormLayer):
    """``FilterResponseNormTlu2d``: ``max(z, tau)`` with ``z`` the normalised, affine-mapped input.
    The side of the kink is kept exactly, in two 1-bit masks (``z > tau``, ``z == tau``), as Mesa's
    ReLU keeps its side: from the 8-bit input alone, every ``z`` within a rounding step of ``tau``
        may land on the wrong side, and those errors lean one way (cosine 0.86-0.92 against stock on
    ``resnetv2_50d_frn``'s norm parameters, also with nearest rounding). The re-run gives ``z`` the
    gradient where it was above, ``tau`` where below, and half to each on a tie (torch.maximum's
    gradient)."""

    def _z_tau(self, x: torch.Tensor) -> tuple:
        # (FilterResponseNormTlu2d.forward's last line: torch.maximum(z, tau))
        return _frn_affine(self, x), self.tau.reshape(1, -1, 1, 1).to(dtype=x.dtype)

    def _forward_keeping(self, x: torch.Tensor) -> tuple:
        if self.tau is None:
            return super()._forward_keeping(x)
        z, tau = self._z_tau(x)
        (above, channels_last), (tie, _) = pack_bits(z > tau), pack_bits(z == tau)
        return torch.maximum(z, tau), (above, tie), channels_last

    def _rerun(self, x: torch.Tensor, kept, info) -> torch.Tensor:
        if self.tau is None:
            return super()._rerun(x, kept, info)
        z, tau = self._z_tau(x)
        above, tie = (unpack_bits(m, z.shape, info) for m in kept)
        # z's share of the gradient: 1 above, 1/2 on a tie, 0 below (only the gradient of this
        # surrogate is taken; two products, where a nested torch.where cost 13% of a CPU step)
        share = above.to(z.dtype) + tie.to(z.dtype) * 0.5
        return z * share + tau * (1 - share)


class _FrnActLayer(_EvoNormLayer):
    """``FilterResponseNormAct2d``: the norm and affine map through the Function, ``act`` after
    it as its own child (a converted activation keeps what it needs of this layer's output)."""

    def _stock_forward(self, x: torch.Tensor) -> torch.Tensor:
        return _frn_affine(self, x)  # (FilterResponseNormAct2d.forward without its last line, self.act)

    def _after(self, y: torch.Tensor) -> torch.Tensor:
        return self.act(y)


FilterResponseNormAct2d = _twin(_frn.FilterResponseNormAct2d, _FrnActLayer)
FilterResponseNormTlu2d = _twin(_frn.FilterResponseNormTlu2d, _TluLayer, "its 8-bit input and side masks")

EvoNorm2dB0 = _twin(_evo.EvoNorm2dB0)
EvoNorm2dB1 = _twin(_evo.EvoNorm2dB1)
EvoNorm2dB2 = _twin(_evo.EvoNorm2dB2)
EvoNorm2dS0 = _twin(_evo.EvoNorm2dS0)
EvoNorm2dS0a = _twin(_evo.EvoNorm2dS0a)
EvoNorm2dS1 = _twin(_evo.EvoNorm2dS1)
EvoNorm2dS1a = _twin(_evo.EvoNorm2dS1a)
EvoNorm2dS2 = _twin(_evo.EvoNorm2dS2)
EvoNorm2dS2a = _twin(_evo.EvoNorm2dS2a)

# stock class -> its Mesa twin (patch/core.py's leaf rules)
EVO_NORM_CLASSES = {cls._stock: cls for cls in (
    EvoNorm2dB0, EvoNorm2dB1, EvoNorm2dB2, EvoNorm2dS0, EvoNorm2dS0a, EvoNorm2dS1, EvoNorm2dS1a, EvoNorm2dS2,
    EvoNorm2dS2a, FilterResponseNormTlu2d, FilterResponseNormAct2d)}

# the classes that apply their ``act`` child to ``x`` inside the norm: it stays stock
STOCK_ACT_INSIDE = (_evo.EvoNorm2dS1, _evo.EvoNorm2dS2)  # (S1a and S2a are subclasses)


def acts_inside(root: nn.Module) -> set:
    """``id``s of the ``act`` children that EvoNorm S1/S2 layers in ``root`` apply to their input
    inside the norm: left stock by the leaf conversion (module doc)."""
    return {id(m.act) for m in root.modules() if isinstance(m, STOCK_ACT_INSIDE) and isinstance(m.act, nn.Module)}
