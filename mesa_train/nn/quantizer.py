"""Quantization options and the ``ActivationQuantizer`` that owns the running estimates.

Contract: ``docs/DESIGN.md`` ("Running estimates"). One training forward of a layer calls
:meth:`ActivationQuantizer.compress` on the tensor that autograd would keep; it returns a
:class:`Packed` (uint8 codes plus *fresh* ``(S, G)`` float32 ``alpha``/``beta`` tensors)
that the layer saves with ``ctx.save_for_backward``; backward calls :func:`decompress`.

* Estimates are buffers (``alpha``, ``beta`` of shape ``(G,)`` float32, ``initialized``
  bool scalar), never parameters, so they live in the ``state_dict`` and never reach an
  optimizer. They stay float32 even after ``module.half()`` / ``.to(torch.bfloat16)``.
* The tensors used for (and saved for) backward are freshly computed; the buffers are only
  ``copy_``-ed afterwards, so calling a module twice before backward is safe.
* A batch whose statistics are not finite never updates the estimates (``torch.where``,
  no host synchronisation); if estimates already exist they are used for that batch.
* When ``num_groups`` exceeds the size ``D`` of the grouped dimension (e.g. a patch
  embedding with 3 input channels and 6 heads), ``min(num_groups, D)`` groups are used and
  only the first entries of the buffers are updated.
"""
from __future__ import annotations

import dataclasses
import itertools
import zlib
from typing import NamedTuple

import torch
from torch import nn

from mesa_train import quant  # noqa: F401  (importing it registers torch.ops.mesa.*)
from mesa_train.quant import traceable

__all__ = ["QuantOptions", "ActivationQuantizer", "Packed", "decompress", "assign_rng_keys", "STATE_BUFFERS"]

ESTIMATORS = ("running", "per_sample")
ROUNDINGS = ("stochastic", "nearest")


@dataclasses.dataclass(frozen=True)
class QuantOptions:
    """Validated quantization options (the paper's defaults).

    num_groups: channel blocks (or heads, for 4-D attention tensors), ``>= 1``.
    decay: running-estimate lambda in ``[0, 1)``.
    estimator: ``"running"`` (paper) or ``"per_sample"`` (ablation, Table 2).
    symmetric: symmetric range ``[-m, m]`` (ablation, Table 4).
    rounding: ``"stochastic"`` (paper, unbiased) or ``"nearest"`` (ablation, Table 3).
    enabled: ``False`` runs the stock layer (stock gradients).
    row_scale: Linear and LayerNorm scale rows far smaller than the rest by a power of two
        before quantizing (``mesa_train.nn.rowscale``; DeiT3's class token). ``False`` saves
        the eager passes it costs (one row-absmax reduction and one scaled copy in forward,
        one multiply in backward; under ``torch.compile`` they fuse into the compression).
    """

    num_groups: int = 1
    decay: float = 0.9
    estimator: str = "running"
    symmetric: bool = False
    rounding: str = "stochastic"
    enabled: bool = True
    row_scale: bool = True

    def __post_init__(self):
        ng = self.num_groups
        if isinstance(ng, bool) or not isinstance(ng, int) or ng < 1:
            raise ValueError(f"num_groups must be an int >= 1, got {ng!r}")
        d = self.decay
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (0.0 <= float(d) < 1.0):
            raise ValueError(f"decay must be a number in [0, 1), got {d!r}")
        object.__setattr__(self, "decay", float(d))
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        for name in ("symmetric", "enabled", "row_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs) -> "QuantOptions":
        """Build from keyword arguments; unknown names raise ``ValueError`` naming the valid ones."""
        unknown = sorted(set(kwargs) - set(cls.names()))
        if unknown:
            raise ValueError(f"unknown quantization option(s) {unknown}; valid options: {list(cls.names())}")
        return cls(**kwargs)

    def replace(self, **kwargs) -> "QuantOptions":
        unknown = sorted(set(kwargs) - set(self.names()))
        if unknown:
            raise ValueError(f"unknown quantization option(s) {unknown}; valid options: {list(self.names())}")
        return dataclasses.replace(self, **kwargs)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.as_dict().items())


class Packed(NamedTuple):
    """A compressed activation: uint8 codes and the float32 ``(S, G)`` statistics used."""

    q: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    dim: int
    num_groups: int


# The op overloads, resolved once: calling ``torch.ops.mesa.x`` (the overload packet) costs an
# overload lookup per call, and these run for every compressed activation of every step.
_OBSERVE = torch.ops.mesa.observe.default
_QUANTIZE = torch.ops.mesa.quantize.default
_DEQUANTIZE = torch.ops.mesa.dequantize.default


def decompress(p: Packed, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize a :class:`Packed` into a tensor of ``dtype`` (traceable under ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return traceable.dequantize(p.q, p.alpha, p.beta, p.dim, p.num_groups, dtype)
    return _DEQUANTIZE(p.q, p.alpha, p.beta, p.dim, p.num_groups, dtype)


# The buffers that make up a quantizer's state (``state_dict`` entries; the checkpoint
# converters in mesa_train.patch.checkpoint read this list).
STATE_BUFFERS = ("alpha", "beta", "initialized", "rng")

_M32 = 0xFFFFFFFF
_construction_count = itertools.count()


def rng_key(name: str) -> int:
    """A quantizer's stochastic-rounding key from its qualified name (stable across
    processes and runs, unlike ``hash``)."""
    return zlib.crc32(name.encode("utf-8")) & _M32


def assign_rng_keys(model: nn.Module, prefix: str = "") -> None:
    """Key every quantizer of ``model`` by its qualified name, so that rounding noise does
    not depend on how many quantizers the process built before (``patch_model`` calls it)."""
    for name, m in model.named_modules(prefix=prefix):
        if isinstance(m, ActivationQuantizer):
            with torch.no_grad():
                m.rng[0] = rng_key(name)


class ActivationQuantizer(nn.Module):
    """Owns one activation's running estimates and compresses it (DESIGN.md).

    Buffers: ``alpha (G,)``, ``beta (G,)`` float32 and ``initialized`` (bool scalar).
    """

    def __init__(self, options: QuantOptions | None = None, *, device=None, **kwargs):
        super().__init__()
        if options is None:
            options = QuantOptions.from_kwargs(**kwargs)
        elif kwargs:
            options = options.replace(**kwargs)
        if not isinstance(options, QuantOptions):
            raise ValueError(f"options must be a QuantOptions, got {type(options).__name__}")
        self.options = options
        self._make_buffers(options.num_groups, device)

    # ------------------------------------------------------------------ state
    def _make_buffers(self, G: int, device=None) -> None:
        self.register_buffer("alpha", torch.zeros(G, dtype=torch.float32, device=device))
        self.register_buffer("beta", torch.zeros(G, dtype=torch.float32, device=device))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool, device=device))
        if "rng" not in self._buffers:
            # [key, counter]: the stochastic-rounding seed of each call is derived on the
            # device from these (mesa::observe), never from torch's global generator, so
            # a patched model draws the same dropout masks as the stock one. The key is
            # replaced by one derived from the module's name when patch_model runs.
            key = rng_key(f"mesa-quantizer-{next(_construction_count)}")
            self.register_buffer("rng", torch.tensor([key, 0], dtype=torch.int64, device=device))

    def set_options(self, **kwargs) -> None:
        """Change options; a new ``num_groups`` resets the estimates (new buffer size)."""
        new = self.options.replace(**kwargs)
        if new.num_groups != self.options.num_groups:
            self._make_buffers(new.num_groups, self.alpha.device)
        self.options = new

    def reset_estimates(self) -> None:
        self.alpha.zero_()
        self.beta.zero_()
        self.initialized.fill_(False)

    def _apply(self, fn, recurse=True):
        # Keep the estimates float32 (and the rng int64) through .half() / .to(dtype): only
        # move their device.
        old = {n: self._buffers[n] for n in ("alpha", "beta", "rng")}
        out = super()._apply(fn, recurse)
        for n, t in old.items():
            new = self._buffers[n]
            if new is not None and new.dtype != t.dtype:
                self._buffers[n] = t.to(device=new.device)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Accept checkpoints saved with another num_groups (or in half precision): resize.
        key = prefix + "alpha"
        if key in state_dict and state_dict[key].shape != self.alpha.shape:
            G = state_dict[key].shape[0]
            self.options = self.options.replace(num_groups=int(G))
            self._make_buffers(int(G), self.alpha.device)
        for n in ("alpha", "beta"):
            k = prefix + n
            if k in state_dict and state_dict[k].dtype != torch.float32:
                state_dict[k] = state_dict[k].float()
        # The rng key belongs to this module's position (see assign_rng_keys): only the
        # counter is state. A checkpoint from before the rng existed keeps the current one.
        k = prefix + "rng"
        if k in state_dict:
            loaded = state_dict[k]
            if loaded.shape != (2,):
                error_msgs.append(f"{k}: expected an int64 tensor of shape (2,), got {tuple(loaded.shape)}")
                return
            state_dict[k] = torch.stack([self.rng[0], loaded[1].to(self.rng.device, torch.int64)])
        n_missing = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if k in missing_keys[n_missing:]:
            missing_keys.remove(k)

    def extra_repr(self) -> str:
        o = self.options
        return f"num_groups={o.num_groups}, estimator={o.estimator}"

    # ------------------------------------------------------------------ compression
    def effective_groups(self, x: torch.Tensor, dim: int) -> int:
        D = x.shape[dim]
        return max(1, min(self.options.num_groups, D))

    @torch.no_grad()
    def compress(self, x: torch.Tensor, dim: int) -> Packed:
        """Quantize ``x`` with groups along ``dim``; returns fresh tensors (see module doc).

        Eager: two ops (``mesa::observe``: batch min/max + estimate update + seed step;
        ``mesa::quantize``), called directly rather than through the checking wrappers of
        :mod:`mesa_train.quant` (the kernels validate their arguments, and Python checks
        here would cost real time for every activation of every step). Under
        ``torch.compile`` the same arithmetic in plain PyTorch (:mod:`mesa_train.quant.traceable`),
        so Inductor can fuse it with the kernels around it.
        """
        opts = self.options
        bufs = self._buffers  # direct: nn.Module.__getattr__ is a slow path, 5 lookups per call
        if bufs["alpha"].device != x.device:
            # a layer without parameters cannot know its device at patch time: follow the input
            self._apply(lambda t: t.to(x.device))
        dim = dim % x.dim()
        D = x.shape[dim]
        G = opts.num_groups if opts.num_groups <= D else max(1, D)
        x = x.contiguous()  # the one copy a non-contiguous input (k, v of a fused qkv) costs
        args = (x, bufs["alpha"], bufs["beta"], bufs["initialized"], bufs["rng"], dim, G, opts.decay,
                opts.estimator == "per_sample", opts.symmetric)
        stochastic = opts.rounding == "stochastic"
        if torch.compiler.is_compiling():
            alpha, beta, seed = traceable.observe(*args)
            q = traceable.quantize(x, alpha, beta, dim, G, stochastic, seed)
        else:
            alpha, beta, seed = _OBSERVE(*args)
            q = _QUANTIZE(x, alpha, beta, dim, G, stochastic, seed)
        return Packed(q, alpha, beta, dim, G)

    @staticmethod
    def decompress(p: Packed, dtype: torch.dtype) -> torch.Tensor:
        return decompress(p, dtype)
