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
from typing import NamedTuple

import torch
from torch import nn

from mesa_train import quant  # noqa: F401  (importing it registers torch.ops.mesa.*)

__all__ = ["QuantOptions", "ActivationQuantizer", "Packed", "decompress", "draw_seed"]

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
    """

    num_groups: int = 1
    decay: float = 0.9
    estimator: str = "running"
    symmetric: bool = False
    rounding: str = "stochastic"
    enabled: bool = True

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
        for name in ("symmetric", "enabled"):
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


def draw_seed() -> int:
    """A fresh stochastic-rounding seed from torch's default CPU generator (no device sync)."""
    return int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64))


def decompress(p: Packed, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize a :class:`Packed` into a tensor of ``dtype``."""
    return torch.ops.mesa.dequantize(p.q, p.alpha, p.beta, p.dim, p.num_groups, dtype)


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
        # Keep the estimates float32 through .half() / .to(dtype): only move their device.
        old = {n: self._buffers[n] for n in ("alpha", "beta")}
        out = super()._apply(fn, recurse)
        for n, t in old.items():
            new = self._buffers[n]
            if new is not None and new.dtype != torch.float32:
                self._buffers[n] = t.to(device=new.device, dtype=torch.float32)
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
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        o = self.options
        return f"num_groups={o.num_groups}, estimator={o.estimator}"

    # ------------------------------------------------------------------ compression
    def effective_groups(self, x: torch.Tensor, dim: int) -> int:
        D = x.shape[dim]
        return max(1, min(self.options.num_groups, D))

    @torch.no_grad()
    def statistics(self, x: torch.Tensor, dim: int):
        """Fresh ``(alpha, beta)`` of shape ``(S, G)`` for ``x``; updates the buffers."""
        opts = self.options
        if self.alpha.device != x.device:
            # a layer without parameters cannot know its device at patch time: follow the input
            self._apply(lambda t: t.to(x.device))
        dim = dim % x.dim()
        G = self.effective_groups(x, dim)
        per_sample = opts.estimator == "per_sample"
        # torch.ops.mesa.* directly, not the checking wrappers of mesa_train.quant: the
        # kernels validate their arguments themselves (ValueError), and this runs for every
        # compressed activation of every step, where Python checks cost real time.
        mn, mx = torch.ops.mesa.group_minmax(x, dim, G, per_sample)
        # one op (one kernel launch on CUDA) for the whole estimate update; its reference
        # is mesa_train.quant.reference.update_estimates
        alpha, beta = torch.ops.mesa.update_estimates(
            mn, mx, self.alpha, self.beta, self.initialized, opts.decay, per_sample, opts.symmetric, x.numel() > 0
        )
        return alpha, beta, dim, G

    @torch.no_grad()
    def compress(self, x: torch.Tensor, dim: int) -> Packed:
        """Quantize ``x`` with groups along ``dim``; returns fresh tensors (see module doc)."""
        opts = self.options
        if self.alpha.device != x.device:
            self._apply(lambda t: t.to(x.device))
        dim = dim % x.dim()
        G = self.effective_groups(x, dim)
        stochastic = opts.rounding == "stochastic"
        # observe = group_minmax + update_estimates + the seed step (one launch on CUDA).
        # Transitional: the rng key is still one draw per call from torch's CPU generator
        # (the global RNG stream is consumed exactly as before: only for stochastic rounding).
        rng = torch.tensor([draw_seed() & 0xFFFFFFFF if stochastic else 0, 0], dtype=torch.int64, device=x.device)
        alpha, beta, seed = torch.ops.mesa.observe(
            x, self.alpha, self.beta, self.initialized, rng, dim, G, opts.decay, opts.estimator == "per_sample",
            opts.symmetric,
        )
        q = torch.ops.mesa.quantize(x, alpha, beta, dim, G, stochastic, seed)
        return Packed(q, alpha, beta, dim, G)

    @staticmethod
    def decompress(p: Packed, dtype: torch.dtype) -> torch.Tensor:
        return decompress(p, dtype)
