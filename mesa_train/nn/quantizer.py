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

import collections
import dataclasses
import itertools
import math
import warnings
import zlib
from typing import NamedTuple

import torch
from torch import nn
from torch._dynamo import compiled_autograd
from torch.utils._python_dispatch import _disable_current_modes

from mesa_train import quant  # noqa: F401  (importing it registers torch.ops.mesa.*)
from mesa_train.quant import traceable
from mesa_train.quant.compile_kernels import traced_as_pytorch
from mesa_train.quant import reference
from mesa_train.quant.reference import affine_cols, multiply_rows, scale_rows, unscale_rows
from mesa_train.nn.checkpoint_phase import FORWARD, checkpoint_phase

__all__ = ["QuantOptions", "ActivationQuantizer", "Packed", "decompress", "assign_rng_keys", "STATE_BUFFERS",
           "LEARNED_BUFFERS", "convert_format", "mark_estimates_ready", "BITS", "SCALES", "LAYOUTS", "ESTIMATORS",
           "ESTIMATOR_CODES", "ROUNDINGS"]

ESTIMATORS = ("running", "per_sample", "learned", "delayed")
# How the C++ layer ops (csrc/layers_common.h, `Estimator`) are told the default-format estimator
ESTIMATOR_CODES = {name: code for code, name in reference.ESTIMATOR_NAMES.items()}
ROUNDINGS = ("stochastic", "nearest")
BITS = (8, 4, 2)
SCALES = ("linear", "pow2")
LAYOUTS = ("channel", "patch4x4")


@dataclasses.dataclass(frozen=True)
class QuantOptions:
    """Validated quantization options (the paper's defaults).

    num_groups: channel blocks (or heads, for 4-D attention tensors), ``>= 1``.
    decay: running-estimate lambda in ``[0, 1)``.
    estimator: ``"running"`` (paper), ``"per_sample"`` (ablation, Table 2), ``"learned"`` (see
        below) or ``"delayed"``: the codes use the running estimates from before this batch,
        which this batch then updates (DESIGN.md, "Delayed estimates"): one pass over the
        activation instead of two (min/max, then quantize), as FP8 training's delayed scaling;
        the first batch is compressed as with ``"running"``.
    symmetric: symmetric range ``[-m, m]`` (ablation, Table 4).
    rounding: ``"stochastic"`` (paper, unbiased) or ``"nearest"`` (ablation, Table 3).
    enabled: ``False`` runs the stock layer (stock gradients).
    row_scale: Linear and LayerNorm scale rows far smaller than the rest by a power of two
        before quantizing (``mesa_train.nn.rowscale``; DeiT3's class token). ``False`` saves
        what it costs: one ``mesa::row_exponents`` op (a row-max pass) per Linear/LayerNorm
        input in forward (the kernels apply the scales in registers; under ``torch.compile``
        with traceable kernels the scaling fuses into the compression).
    bits: code width, 8 (paper), 4 or 2 (codes packed 2 or 4 per byte; DESIGN.md "Variants").
    scale: ``"linear"`` (step = range / (2**bits - 1)) or ``"pow2"`` (ALT: the smallest
        power of two covering the range at that width).
    layout: ``"channel"`` (channel / head groups, the paper) or ``"patch4x4"`` (conv inputs
        (B, C, H, W) only: a min/max per 4x4 spatial block of each channel, fp16 statistics).
    estimator ``"learned"``: per-group clipping thresholds trained in the log domain (Adam)
        on the expected error of the stored tensor (DESIGN.md "Learned clipping").
    clip_horizon: ``estimator="learned"`` only, a number ``>= 1``: the thresholds minimise
        ``clipping bias**2 + rounding variance / clip_horizon``, the expected squared error of
        the mean of that many independently rounded copies. 1 (default) is the stored
        tensor's own error; larger values clip less, because stochastic rounding's noise
        averages out over the steps (and the elements) a gradient sums while the clipping
        bias does not (results/variants/digits.md: 2-bit accuracy).
    """

    num_groups: int = 1
    decay: float = 0.9
    estimator: str = "running"
    symmetric: bool = False
    rounding: str = "stochastic"
    enabled: bool = True
    row_scale: bool = True
    bits: int = 8
    scale: str = "linear"
    layout: str = "channel"
    clip_horizon: float = 1.0

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
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits!r}")
        object.__setattr__(self, "bits", int(self.bits))
        if self.scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {self.scale!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.estimator == "learned" and self.symmetric:
            raise ValueError("estimator='learned' trains a lower and an upper threshold per group; symmetric=True "
                             "is not supported with it (valid: symmetric=False, or estimator in ('running', "
                             "'per_sample'))")
        h = self.clip_horizon
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not math.isfinite(h) or h < 1:
            raise ValueError(f"clip_horizon must be a finite number >= 1 (1: the stored tensor's own expected "
                             f"error), got {h!r}")
        object.__setattr__(self, "clip_horizon", float(h))
        if self.clip_horizon != 1.0 and self.estimator != "learned":
            raise ValueError(f"clip_horizon={h!r} weighs the clipping of estimator='learned' only; with "
                             f"estimator={self.estimator!r} leave it at 1 (valid estimators for it: 'learned')")
        if self.estimator == "delayed" and (self.bits != 8 or self.scale != "linear" or self.layout != "channel"):
            raise ValueError("estimator='delayed' quantizes the paper's 8-bit channel format in one pass; "
                             "valid with it: bits=8, scale='linear', layout='channel' "
                             f"(got bits={self.bits}, scale={self.scale!r}, layout={self.layout!r}); "
                             "other formats take "
                             "estimator in ('running', 'per_sample', 'learned')")
        if self.layout == "patch4x4" and (self.estimator != "running" or self.symmetric):
            raise ValueError("layout='patch4x4' takes each 4x4 block's own min/max (per sample): it supports "
                             "estimator='running' (the default) and symmetric=False only, got "
                             f"estimator={self.estimator!r}, symmetric={self.symmetric!r}")

    @property
    def is_default_format(self) -> bool:
        """8-bit channel-group codes with min/max ranges: the paper's format (mesa::quantize)."""
        return self.bits == 8 and self.scale == "linear" and self.layout == "channel" and self.estimator != "learned"

    @property
    def channel_layout(self) -> bool:
        """Codes grouped along the channel dim (any bits and scale): what a channels-last
        activation may be compressed as through its NHWC view (``_common.nhwc_view``)."""
        return self.layout == "channel"

    @property
    def format_record(self) -> tuple[int, int, int, int]:
        """What a checkpoint records about the stored format (bits, scale, layout, learned)."""
        return (self.bits, SCALES.index(self.scale), LAYOUTS.index(self.layout), int(self.estimator == "learned"))

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

    def interned(self) -> "QuantOptions":
        """The one instance of these option values that every Mesa layer holding them shares.

        Why: a fused pair of layers (LayerNorm + Linear, GELU + Linear) must carry equal
        options, and the check runs in forward. Compared with ``==``, torch.compile traces the
        dataclass's ``__eq__`` and guards on every field of both layers' options each step
        (864 of the guards of a compiled 12-block Mesa ViT, about a fifth of its guard tree);
        shared instances compare with ``is`` first (:func:`same_options`), two guards a pair."""
        return _INTERNED.setdefault(self, self)

    # immutable: a copied model (deepcopy for an EMA, a bench's fresh row) keeps the interned
    # instance instead of an equal one that same_options would compare field by field
    def __copy__(self) -> "QuantOptions":
        return self

    def __deepcopy__(self, memo) -> "QuantOptions":
        return self

    def __str__(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.as_dict().items())


# QuantOptions.interned: one instance per distinct set of values (a handful per process)
_INTERNED: dict[QuantOptions, QuantOptions] = {}


def same_options(a: QuantOptions, b: QuantOptions) -> bool:
    """``a == b``, by identity where both are interned (the layers' options always are): under
    torch.compile an ``is`` costs two guards, an ``==`` one guard per field of each."""
    return a is b or a == b


class Packed(NamedTuple):
    """A compressed activation: uint8 codes and the float32 ``(S, G)`` statistics used.

    ``fmt`` is ``None`` for the paper's format (``q`` has the activation's shape, one code
    per byte), else a tuple of Python constants saying how to decompress (DESIGN.md,
    "Variants"): ``("bits", bits, pow2, shape)`` (``q`` 1-d, packed codes) or
    ``("patch4x4", bits, pow2, shape)`` (``alpha``/``beta`` then hold each 4x4 block's
    float16 upper/lower bound, ``(N, 1)``).
    """

    q: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    dim: int
    num_groups: int
    fmt: tuple | None = None


# The op overloads, resolved once: calling ``torch.ops.mesa.x`` (the overload packet) costs an
# overload lookup per call, and these run for every compressed activation of every step.
_OBSERVE = torch.ops.mesa.observe.default
_QUANTIZE = torch.ops.mesa.quantize.default
_DEQUANTIZE = torch.ops.mesa.dequantize.default
_QUANTIZE_OBSERVE = torch.ops.mesa.quantize_observe.default
_ROW_EXPONENTS = torch.ops.mesa.row_exponents.default
_COMPRESS = torch.ops.mesa.compress.default
_QUANTIZE_BITS = torch.ops.mesa.quantize_bits.default
_DEQUANTIZE_BITS = torch.ops.mesa.dequantize_bits.default
# Whole-layer C++ ops (csrc/layers_autograd.cpp) exist only in the compiled extension; with
# the pure-PyTorch fallback the layers keep their Python Functions.
_FUSED_LAYERS = quant.extension_error is None and hasattr(torch.ops.mesa, "gelu_train")


def layer_op_code(opts: QuantOptions) -> int:
    """The ``estimator`` argument of the C++ layer ops for ``opts`` (csrc/layers_common.h,
    ``make_quantizer``): the estimator's code, plus ``4 * bits + 64 * pow2`` for a variant
    format (the default format: the code alone)."""
    code = ESTIMATOR_CODES[opts.estimator]
    if opts.is_default_format:
        return code
    return code + _format_part(opts.bits, opts.scale == "pow2")


def format_code(fmt: tuple | None) -> int:
    """The ``shared_*_format`` argument of ``mesa::matmul_train`` for codes of
    :attr:`Packed.fmt` ``fmt`` (csrc/layers_common.h, ``shared_format``): 0 for the default
    format, else ``4 * bits + 64 * pow2`` of a ``("bits", ...)`` format, as
    :func:`layer_op_code` adds it."""
    if fmt is None:
        return 0
    kind, bits, pow2, _ = fmt
    if kind != "bits":
        raise ValueError(f"format_code: only the default format and channel-group formats ('bits') have a code, "
                         f"got {kind!r}")
    return _format_part(bits, pow2)


def _format_part(bits: int, pow2: bool) -> int:
    """A variant format as the C++ ops take it (csrc/layers_common.h, ``decode_format``:
    ``kFormatBits * bits + kFormatPow2 * pow2``)."""
    return 4 * bits + 64 * bool(pow2)


def fused_layers_on() -> bool:
    """Whether a layer runs its C++ layer op now: the extension has them, this is eager (under
    ``torch.compile`` the traceable Python Functions run), and outside compiled autograd's
    context (which ``torch.compile`` enters around a compiled function when
    ``torch._dynamo.config.compiled_autograd`` is set, its graph breaks included). Compiled
    autograd calls a C++ node as an opaque function, a graph break each (a resnet10t's first
    compiled step 69 s against 5.7 s with the Python Functions, results/compiled-autograd),
    while it traces a Python Function's backward into its graph. The context is one module
    attribute (under 10 ns a call); the flag itself, a config lookup of about 1.5 us, is left to
    the scale branch, which needs it for correctness (conv.compiled_autograd_may_run). Reads
    ``_FUSED_LAYERS`` at call time: the tests switch it off to compare the two paths."""
    return _FUSED_LAYERS and not torch.compiler.is_compiling() and not compiled_autograd.compiled_autograd_enabled


def _dequantize_bits(q, alpha, beta, shape, dim, G, bits, pow2, dtype):
    if traced_as_pytorch(q):
        return traceable.dequantize_bits(q, alpha, beta, shape, dim, G, bits, pow2, dtype)
    return _DEQUANTIZE_BITS(q, alpha, beta, list(shape), dim, G, bits, pow2, dtype)


def decompress(p: Packed, dtype: torch.dtype, row_exp: torch.Tensor | None = None,
               row_mul: torch.Tensor | None = None, col_scale: torch.Tensor | None = None,
               col_shift: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize a :class:`Packed` into a tensor of ``dtype`` (traceable under ``torch.compile``);
    ``row_exp``: the power-of-two row scales it was compressed with (``nn/rowscale.py``), undone;
    ``row_mul``: float32 factors per row applied after (``reference.multiply_rows``; LayerNorm's
    ``1 / rstd``); ``col_scale`` / ``col_shift``: float32 per column of the last dim, on the
    float32 values, then rounded once to ``dtype`` (``reference.affine_cols``; LayerNorm's
    ``gamma`` and ``beta``)."""
    if p.fmt is None and not traced_as_pytorch(p.q):  # (all inside the kernel)
        return _DEQUANTIZE(p.q, p.alpha, p.beta, p.dim, p.num_groups, dtype, row_exp, row_mul, col_scale, col_shift)
    if col_scale is not None or col_shift is not None:
        return affine_cols(decompress(p, torch.float32, row_exp, row_mul), col_scale, col_shift).to(dtype)
    return multiply_rows(unscale_rows(_decompress_format(p, dtype), row_exp), row_mul)


def _decompress_format(p: Packed, dtype: torch.dtype) -> torch.Tensor:
    if p.fmt is None:
        return traceable.dequantize(p.q, p.alpha, p.beta, p.dim, p.num_groups, dtype)
    kind, bits, pow2, shape = p.fmt
    if kind == "bits":
        return _dequantize_bits(p.q, p.alpha, p.beta, shape, p.dim, p.num_groups, bits, pow2, dtype)
    # patch4x4: blocks of the (replicate-)padded map, one (lo, hi) float16 pair per block
    B, C, H, W = shape
    Hb, Wb = -(-H // 4), -(-W // 4)
    lo = p.beta.float()
    alpha = p.alpha.float() - lo
    xb = _dequantize_bits(p.q, alpha, lo, (B * C * Hb * Wb, 16), 1, 1, bits, pow2, dtype)
    x = xb.view(B, C, Hb, Wb, 4, 4).permute(0, 1, 2, 4, 3, 5).reshape(B, C, Hb * 4, Wb * 4)
    return x[:, :, :H, :W] if (Hb * 4 != H or Wb * 4 != W) else x


# The buffers that make up a quantizer's state (``state_dict`` entries; the checkpoint
# converters in mesa_train.patch.checkpoint read this list).
STATE_BUFFERS = ("alpha", "beta", "initialized", "rng")
# rounding counters a quantizer keeps from checkpointed forwards for their recomputations
# (consumed in backward; the bound only matters where a checkpointed forward has no backward)
_KEPT_COUNTERS = 64
# estimator="learned" adds these (DESIGN.md, "Learned clipping")
LEARNED_BUFFERS = ("clip_center", "clip_log", "clip_m", "clip_v", "clip_steps")
# Checkpoints of a quantizer whose stored format is not the paper's 8-bit one carry
# ``<prefix>format`` = int64 [bits, scale, layout, learned] (QuantOptions.format_record);
# loading into a quantizer with another format is an error (convert_format converts).
FORMAT_KEY = "format"
_DEFAULT_RECORD = (8, 0, 0, 0)
# ``per_sample_by_reuse: True`` in a Mesa layer's state_dict metadata (``_metadata[prefix]``,
# beside ``version``): the layer was switched to per-sample ranges because one forward calls it
# more than once (patch/reuse.py); a model patched afresh takes the switch when it loads the
# checkpoint (MesaLayer._load_from_state_dict), as a resumed run must to equal an uninterrupted
# one. Metadata, not a tensor entry: the keys stay those of the model before the switch (an
# entry broke timm's ModelEmaV3, which pairs two state_dicts by position, and the key checks of
# checkpoint loading; a review)
REUSE_KEY = "per_sample_by_reuse"
# (the flag on the layer's quantizers)
REUSE_FLAG = "_per_sample_by_reuse"

# Adam on the log2 thresholds of estimator="learned" (per group, lower and upper)
LEARNED_LR = 0.05
LEARNED_BETAS = (0.9, 0.999)
LEARNED_EPS = 1e-8

_M32 = 0xFFFFFFFF
_construction_count = itertools.count()


def mark_estimates_ready(model: nn.Module) -> int:
    """Tell every ``estimator="delayed"`` quantizer of ``model`` whether its running estimates
    are initialized (one host read for all of them): where they are, the compression traced
    under ``torch.compile`` (``compile_kernels=traceable``) takes its one-pass form, which
    Inductor fuses into the kernel producing the activation. Call it after the first training
    step (the trainer does, when it compiles); the compiled graph is then rebuilt once.
    Returns how many quantizers are ready. Eager and the ops path decide on the device and
    need no call."""
    delayed = [m for m in model.modules() if isinstance(m, ActivationQuantizer) and m.options.estimator == "delayed"]
    if not delayed:
        return 0
    device = delayed[0].initialized.device  # (the flags gathered on one device, then read once)
    flags = torch.stack([m.initialized.reshape(()).to(device) for m in delayed]).tolist()
    for m, ready in zip(delayed, flags):
        m._delayed_ready = bool(ready)
    return sum(bool(f) for f in flags)


def rng_key(name: str) -> int:
    """A quantizer's stochastic-rounding key from its qualified name (stable across
    processes and runs, unlike ``hash``)."""
    return zlib.crc32(name.encode("utf-8")) & _M32


def assign_rng_keys(model: nn.Module, prefix: str = "") -> None:
    """Key every quantizer of ``model`` by its qualified name, so that rounding noise does
    not depend on how many quantizers the process built before (``patch_model`` calls it)."""
    for name, m in model.named_modules(prefix=prefix):
        if isinstance(m, ActivationQuantizer):
            m._rng_key = rng_key(name)  # (kept on the host too: a meta buffer holds no value)
            with torch.no_grad():
                m.rng[0] = m._rng_key


class ActivationQuantizer(nn.Module):
    """Owns one activation's running estimates and compresses it (DESIGN.md).

    Buffers: ``alpha (G,)``, ``beta (G,)`` float32 and ``initialized`` (bool scalar).
    """

    def __init__(self, options: QuantOptions | None = None, *, device=None, clippable: bool = True, **kwargs):
        super().__init__()
        # estimator="learned": whether this tensor's thresholds are learned (True) or stay at
        # the running range (False: a softmax's probabilities, whose mass is in many small
        # entries and whose gradient is in a few large ones; DESIGN.md "Learned clipping")
        self.clippable = bool(clippable)
        if options is None:
            options = QuantOptions.from_kwargs(**kwargs)
        elif kwargs:
            options = options.replace(**kwargs)
        if not isinstance(options, QuantOptions):
            raise ValueError(f"options must be a QuantOptions, got {type(options).__name__}")
        # interned as the layers' (QuantOptions.interned): a layer and its quantizers, and every
        # block's, then hold the same instance, so torch.compile's aliasing guards between them
        # hold in each block alike (repeated blocks share one graph)
        self.options = options.interned()
        self._make_buffers(options.num_groups, device)
        # estimator="delayed" under torch.compile with traceable kernels: whether the host
        # knows the estimates are initialized (mark_estimates_ready, or a loaded checkpoint),
        # so the traced compression can take its one-pass form (traceable.quantize_observe)
        self._delayed_ready = False

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
            self._rng_key = rng_key(f"mesa-quantizer-{next(_construction_count)}")
            self.register_buffer("rng", torch.tensor([self._rng_key, 0], dtype=torch.int64, device=device))
        self._make_learned_buffers(G, device)

    def _make_learned_buffers(self, G: int, device=None) -> None:
        if self.options.estimator != "learned":
            for n in LEARNED_BUFFERS:
                self._buffers.pop(n, None)
            return
        f32 = dict(dtype=torch.float32, device=device)
        # center c and log2 distances (t_lo, t_hi): thresholds c - 2**t_lo, c + 2**t_hi
        self.register_buffer("clip_center", torch.zeros(G, **f32))
        self.register_buffer("clip_log", torch.zeros(2, G, **f32))
        self.register_buffer("clip_m", torch.zeros(2, G, **f32))  # Adam moments
        self.register_buffer("clip_v", torch.zeros(2, G, **f32))
        self.register_buffer("clip_steps", torch.zeros((), dtype=torch.float32, device=device))

    def set_options(self, **kwargs) -> None:
        """Change options; a new ``num_groups`` resets the estimates (new buffer size)."""
        new = self.options.replace(**kwargs).interned()
        old = self.options
        self.options = new
        if new.num_groups != old.num_groups:
            self._make_buffers(new.num_groups, self.alpha.device)
        elif (new.estimator == "learned") != (old.estimator == "learned"):
            self._make_learned_buffers(new.num_groups, self.alpha.device)

    def reset_estimates(self) -> None:
        self.alpha.zero_()
        self.beta.zero_()
        self.initialized.fill_(False)
        self._delayed_ready = False
        for n in LEARNED_BUFFERS:
            if n in self._buffers:
                self._buffers[n].zero_()

    def _apply(self, fn, recurse=True):
        # Keep the estimates float32 (and the rng int64) through .half() / .to(dtype): only
        # move their device.
        old = {n: self._buffers[n] for n in ("alpha", "beta", "rng", *LEARNED_BUFFERS) if n in self._buffers}
        out = super()._apply(fn, recurse)
        for n, t in old.items():
            new = self._buffers[n]
            if new is not None and new.dtype != t.dtype:
                self._buffers[n] = t.to(device=new.device) if not t.is_meta else torch.empty_like(t, device=new.device)
        if old["alpha"].is_meta and not self._buffers["alpha"].is_meta:
            # off the meta device (to_empty, after building under torch.device("meta")): the
            # buffers are uninitialized memory, and a meta tensor held no state to keep, so
            # start afresh as a new quantizer does, with this module's own rounding key
            self._start_afresh()
        return out

    @torch.no_grad()
    def _start_afresh(self) -> None:
        self.reset_estimates()
        self.rng.copy_(torch.tensor([self.rounding_key(), 0], dtype=torch.int64))

    def rounding_key(self) -> int:
        """The stochastic-rounding key (``rng[0]``): set from the module's name by
        ``assign_rng_keys``, known on the host even while the buffers are on meta."""
        key = getattr(self, "_rng_key", None)  # (a quantizer pickled before it was kept)
        return int(self.rng[0]) if key is None else key

    # The entry written beside the buffers reads as an attribute too: DCP (FSDP's sharded
    # checkpoints) resolves every state_dict key by getattr, and failed on it (a review: any
    # non-default format crashed an FSDP run at its first checkpoint)
    @property
    def format(self) -> torch.Tensor:
        return torch.tensor(self.options.format_record, dtype=torch.int64)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.options.format_record != _DEFAULT_RECORD:
            destination[prefix + FORMAT_KEY] = self.format

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # (read by the layer above, which loads first: MesaLayer._load_from_state_dict)
        fk = prefix + FORMAT_KEY
        saved = tuple(int(v) for v in state_dict.pop(fk).tolist()) if fk in state_dict else _DEFAULT_RECORD
        if saved != self.options.format_record and (prefix + "alpha") in state_dict:
            error_msgs.append(
                f"{prefix[:-1] or 'quantizer'}: the checkpoint was saved with {describe_record(saved)}, but this "
                f"model is patched with {describe_record(self.options.format_record)}. Patch the model with the "
                "checkpoint's options, or convert the checkpoint explicitly with "
                "mesa_train.nn.quantizer.convert_format(state_dict, bits=..., scale=..., layout=..., estimator=...)")
            return
        # Accept checkpoints saved with another num_groups (or in half precision): resize.
        key = prefix + "alpha"
        if key in state_dict and state_dict[key].shape != self.alpha.shape:
            G = state_dict[key].shape[0]
            # (said: an explicit patch_model(num_groups=...) is replaced; one text, so one warning a load site)
            warnings.warn("mesa_train: a checkpoint's estimates were saved with another num_groups: the layers now "
                          "use the checkpoint's groups, not those patch_model was given (describe(model) lists them)",
                          stacklevel=2)
            self.options = self.options.replace(num_groups=int(G)).interned()
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
            # (the key from the host: on meta, rng holds none, and load_state_dict(assign=True)
            # then installs this tensor as it is)
            device = loaded.device if self.rng.is_meta else self.rng.device
            counter = loaded[1:].to(device, torch.int64)
            state_dict[k] = torch.cat([torch.tensor([self.rounding_key()], dtype=torch.int64, device=device), counter])
        n_missing = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if k in missing_keys[n_missing:]:
            missing_keys.remove(k)
        # learned thresholds absent (convert_format): they restart from the running range
        for n in LEARNED_BUFFERS:
            if prefix + n in missing_keys[n_missing:]:
                missing_keys.remove(prefix + n)
        # a resumed run's estimates are initialized: the traced delayed path may fuse at once
        # (one host read per delayed quantizer, at load time; other estimators never read it)
        if self.options.estimator == "delayed" and self.initialized.device.type != "meta":
            self._delayed_ready = bool(self.initialized.reshape(-1)[0])

    def extra_repr(self) -> str:
        o = self.options
        extra = "" if o.is_default_format else f", bits={o.bits}, scale={o.scale}, layout={o.layout}"
        if o.estimator == "learned":
            extra += f", clip_horizon={o.clip_horizon:g}" + ("" if self.clippable else ", not clipped: running range")
        return f"num_groups={o.num_groups}, estimator={o.estimator}{extra}"

    # ------------------------------------------------------------------ compression
    def effective_groups(self, x: torch.Tensor, dim: int) -> int:
        D = x.shape[dim]
        return max(1, min(self.options.num_groups, D))

    def _follow_device(self, x: torch.Tensor) -> dict:
        """The buffers, moved to ``x``'s device first if needed (a layer without parameters
        cannot know its device at patch time: it follows its input). ``self._buffers``
        directly: ``nn.Module.__getattr__`` is a slow path, several lookups per call."""
        bufs = self._buffers
        if bufs["alpha"].device != x.device:
            # (from meta, a fresh start: _apply; a meta tensor has no value to copy)
            self._apply(lambda t: torch.empty_like(t, device=x.device) if t.is_meta else t.to(x.device))
        return bufs

    def _state(self, x: torch.Tensor) -> dict:
        """The buffers this call's ops read and update in place: the module's own (on ``x``'s
        device), or in a non-reentrant checkpoint's recomputation (``nn/checkpoint_phase.py``) scratch
        copies, so the state is updated once a step, as without checkpointing. The scratch
        counter is the one the matching call of the checkpoint's first pass found (kept in
        order, a few per quantizer), so a recomputed call draws its forward's seed, also for a
        module called twice in a segment; without one (a second backward through a retained
        graph), the counter one step back."""
        bufs = self._follow_device(x)
        phase = checkpoint_phase()
        if not phase:
            return bufs
        # (outside torch's dispatch modes: selective checkpointing replays the forward's ops
        # exactly, and these copies are not among them)
        with _disable_current_modes():
            seeds = self.__dict__.setdefault("_checkpoint_counters", collections.deque(maxlen=_KEPT_COUNTERS))
            if phase == FORWARD:
                seeds.append(bufs["rng"][1:].clone())
                return bufs
            scratch = {name: t.clone() for name, t in bufs.items() if t is not None}
            counter = scratch["rng"][1:]
            if seeds:
                counter.copy_(seeds.popleft())
            else:  # (the counter modulo 2**32, as the ops keep it)
                counter.copy_(((counter & 0xFFFFFFFF) - 1) & 0xFFFFFFFF)
        return scratch

    def fused_layer_args(self, x: torch.Tensor) -> tuple | None:
        """The quantizer arguments of the C++ layer ops (``mesa::gelu_train``,
        ``mesa::softmax_train``: a whole Mesa layer with a C++ autograd node, see
        ``csrc/layers_autograd.cpp``), or ``None`` where a layer must use its Python Function:
        under ``torch.compile`` (the traceable path), when the extension is not loaded (the
        reference ops), and for the formats the ops do not take (they take the default one and
        the variants with channel groups and min/max ranges, in ``layer_op_code``; not
        patch4x4, not learned thresholds: DESIGN.md, "Variant formats in the C++ ops")."""
        opts = self.options
        if not fused_layers_on():
            return None
        if opts.is_default_format or (opts.channel_layout and opts.estimator != "learned"):
            code = layer_op_code(opts)
        else:
            return None
        bufs = self._state(x)
        return (bufs["alpha"], bufs["beta"], bufs["initialized"], bufs["rng"], opts.num_groups, opts.decay, code,
                opts.symmetric, opts.rounding == "stochastic")

    def fused_state_args(self, x: torch.Tensor) -> tuple | None:
        """``fused_layer_args`` as the ops with a ``Tensor[] state`` argument take them (gated,
        StarReLU, Affine, Normalize, GRN, MatMul, SDPA): the four buffers as one list, then the
        options; ``None`` where the layer must use its Python Function."""
        fused = self.fused_layer_args(x)
        return None if fused is None else (list(fused[:4]), *fused[4:])

    @torch.no_grad()
    def compress(self, x: torch.Tensor, dim: int, row_exp: torch.Tensor | None = None) -> Packed:
        """Quantize ``x`` with groups along ``dim``; returns fresh tensors (see module doc).
        ``row_exp``: int8 power-of-two row scales (``nn/rowscale.py``): the rows are taken as
        ``x * 2**k`` (inside the kernels where they are the extension's ops); to have them
        found too, in the same op, use :meth:`compress_rows`.

        With the extension: one op, ``mesa::compress`` (``mesa::observe``: batch min/max +
        estimate update + seed step, then ``mesa::quantize``; ``mesa::quantize_observe`` for
        the delayed estimator), called directly rather than through the checking wrappers of
        :mod:`mesa_train.quant` (the kernels validate their arguments, and Python checks
        here would cost real time for every activation of every step). One op, not two,
        because under ``torch.compile`` Inductor hands every opaque op its own copy of an
        input it has not yet written to memory (DESIGN.md, "One op per compression"). Under
        ``torch.compile`` either that op (an opaque graph node: the default with the
        extension) or the same arithmetic in plain PyTorch (:mod:`mesa_train.quant.traceable`),
        which Inductor can fuse with the kernels around it; see
        :mod:`mesa_train.quant.compile_kernels`.
        """
        return self._compress(x, dim, row_exp=row_exp)[0]

    @torch.no_grad()
    def compress_rows(self, x: torch.Tensor, row_dims: int, max_k: int) -> tuple[Packed, torch.Tensor]:
        """``(packed, k)``: ``x`` with groups over its last dim, its rows taken as ``x * 2**k``
        with ``k = row_exponents(x, row_dims, max_k)`` (``nn/rowscale.py``), found in the same
        op as the compression where that is the extension's ``mesa::compress``."""
        return self._compress(x, x.dim() - 1, rows=(row_dims, max_k))

    def takes_row_norm(self, x: torch.Tensor) -> bool:
        """Whether :meth:`compress_normalized` hands ``x`` and its rows' mean and rstd to one op
        (``mesa::compress``, whose kernels compute ``x_hat`` themselves): the default format,
        not traced, the running or per-sample estimator, ``x`` float32 / float16 / bfloat16.
        Otherwise the caller compresses the normalised copy itself."""
        return (self.options.is_default_format and self.options.estimator != "delayed"
                and x.dtype in reference.QUANT_DTYPES and not traced_as_pytorch(x))

    @torch.no_grad()
    def compress_normalized(self, x: torch.Tensor, row_mean: torch.Tensor, row_rstd: torch.Tensor, row_dims: int,
                            max_k: int) -> tuple[Packed, torch.Tensor | None]:
        """``(packed, k)``: a LayerNorm's ``x_hat = (x - mean) * rstd`` (float32, per row of the
        last ``row_dims`` dims; ``reference.normalize_rows``) compressed with groups over the
        last dim, its rows scaled by ``2**k`` when ``max_k > 0`` (else ``k`` is ``None``), as one
        ``mesa::compress`` given ``x``, ``row_mean`` and ``row_rstd``: ``x_hat`` is never
        written (under ``torch.compile`` Inductor wrote it in float32 for the op to read, a
        pass over the activation per LayerNorm). Only where :meth:`takes_row_norm`."""
        packed, k = self._compress(x, x.dim() - 1, rows=(row_dims, max_k), row_norm=(row_mean, row_rstd))
        return packed, (k if max_k > 0 else None)

    def _compress(self, x: torch.Tensor, dim: int, row_exp: torch.Tensor | None = None,
                  rows: tuple[int, int] | None = None,
                  row_norm: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[Packed, torch.Tensor | None]:
        """``row_norm``: a LayerNorm's (mean, rstd), for the one-op path only (``takes_row_norm``)."""
        opts = self.options
        bufs = self._state(x)
        traced = traced_as_pytorch(x)
        one_op = not traced and opts.is_default_format and row_exp is None
        if rows is not None and not one_op:  # the row exponents first, as their own op
            row_exp = reference.row_exponents(x, *rows) if traced else _ROW_EXPONENTS(x, *rows)
        k = row_exp
        if row_exp is not None and (traced or not opts.is_default_format):
            x, row_exp = scale_rows(x, row_exp), None  # (Inductor fuses the multiply when traced)
        if not opts.is_default_format:
            return self._compress_variant(x, dim, bufs), k
        dim = dim % x.dim()
        G = reference.capped_groups(opts.num_groups, x.shape[dim])
        stochastic = opts.rounding == "stochastic"
        state = (bufs["alpha"], bufs["beta"], bufs["initialized"], bufs["rng"])
        if one_op:  # x as it is: the op copies a strided x once for all its kernels, or not at all where
            # the CUDA kernels read it in place (timm's q, k, v: csrc/mesa_common.h, "strided inputs")
            row_dims, max_k = rows if rows is not None else (0, 0)
            q, alpha, beta, k = _COMPRESS(x, *state, dim, G, opts.decay, ESTIMATOR_CODES[opts.estimator],
                                          opts.symmetric, stochastic, row_dims, max_k, *(row_norm or ()))
            return Packed(q, alpha, beta, dim, G), (k if rows is not None else None)
        x = x.contiguous()  # the one copy a non-contiguous input (k, v of a fused qkv) costs
        if opts.estimator == "delayed":  # one pass: quantize with the estimates so far, then observe
            qo_args = (x, *state, dim, G, opts.decay, opts.symmetric, stochastic)
            if traced:
                q, alpha, beta = traceable.quantize_observe(*qo_args, ready=self._delayed_ready)
            else:
                q, alpha, beta = _QUANTIZE_OBSERVE(*qo_args, row_exp)
            return Packed(q, alpha, beta, dim, G), k
        args = (x, *state, dim, G, opts.decay, opts.estimator == "per_sample", opts.symmetric)
        if traced:  # under torch.compile: see mesa_train/quant/compile_kernels.py
            alpha, beta, seed = traceable.observe(*args)
            q = traceable.quantize(x, alpha, beta, dim, G, stochastic, seed)
        else:
            alpha, beta, seed = _OBSERVE(*args, row_exp)
            q = _QUANTIZE(x, alpha, beta, dim, G, stochastic, seed, row_exp)
        return Packed(q, alpha, beta, dim, G), k

    @staticmethod
    def decompress(p: Packed, dtype: torch.dtype) -> torch.Tensor:
        return decompress(p, dtype)

    # ------------------------------------------------------------------ variants
    def format_of(self, x: torch.Tensor) -> tuple | None:
        """The ``Packed.fmt`` that :meth:`compress` gives ``x`` (channel layouts)."""
        o = self.options
        if o.is_default_format:
            return None
        return ("bits", o.bits, o.scale == "pow2", tuple(x.shape))

    def _observe(self, x, dim, G, per_sample, b: dict):
        o = self.options
        args = (x, b["alpha"], b["beta"], b["initialized"], b["rng"], dim, G, o.decay, per_sample, o.symmetric)
        return traceable.observe(*args) if traced_as_pytorch(x) else _OBSERVE(*args)

    def _quantize_bits(self, x, alpha, beta, dim, G, seed):
        o = self.options
        args = (x, alpha, beta, dim, G, o.bits, o.scale == "pow2", o.rounding == "stochastic", seed)
        return traceable.quantize_bits(*args) if traced_as_pytorch(x) else _QUANTIZE_BITS(*args)

    def _compress_variant(self, x: torch.Tensor, dim: int, bufs: dict) -> Packed:
        o = self.options
        dim = dim % x.dim()
        if o.layout == "patch4x4":
            return self._compress_patch4x4(x, dim, bufs)
        G = reference.capped_groups(o.num_groups, x.shape[dim])
        x = x.contiguous()
        alpha, beta, seed = self._observe(x, dim, G, o.estimator == "per_sample", bufs)
        if o.estimator == "learned" and self.clippable:
            alpha, beta = learned_thresholds(self, x, dim, G, alpha, beta, bufs)
        q = self._quantize_bits(x, alpha, beta, dim, G, seed)
        return Packed(q, alpha, beta, dim, G, ("bits", o.bits, o.scale == "pow2", tuple(x.shape)))

    def _compress_patch4x4(self, x: torch.Tensor, dim: int, bufs: dict) -> Packed:
        """min/max per 4x4 spatial block of each channel (DESIGN.md, "patch4x4")."""
        o = self.options
        if x.dim() != 4 or dim != 1:
            raise ValueError(f"layout='patch4x4' needs a conv activation (B, C, H, W) grouped over dim 1, got a "
                             f"{x.dim()}-d tensor of shape {tuple(x.shape)} (dim {dim}); valid layouts for other "
                             f"tensors: 'channel'")
        B, C, H, W = x.shape
        Hb, Wb = -(-H // 4), -(-W // 4)
        if Hb * 4 != H or Wb * 4 != W:  # replicate: the padding changes no block's min/max
            x = torch.nn.functional.pad(x, (0, Wb * 4 - W, 0, Hb * 4 - H), mode="replicate")
        xb = x.reshape(B, C, Hb, 4, Wb, 4).permute(0, 1, 2, 4, 3, 5).reshape(B * C * Hb * Wb, 16)
        # per "sample" (= block) statistics, one group: the buffers keep the envelope for logs
        alpha, beta, seed = self._observe(xb, 1, 1, True, bufs)
        lo, hi = _f16_bounds(beta, beta + alpha)
        lo32 = lo.float()
        q = self._quantize_bits(xb, hi.float() - lo32, lo32, 1, 1, seed)
        return Packed(q, hi, lo, 1, 1, ("patch4x4", o.bits, o.scale == "pow2", (B, C, H, W)))


_F16_MAX = 65504.0


def _f16_bounds(lo: torch.Tensor, hi: torch.Tensor):
    """float16 ``(lo', hi')`` with ``lo' <= lo`` and ``hi' >= hi`` (directed rounding), values
    clamped to the float16 range first (beyond it the codes saturate)."""
    lo = lo.clamp(-_F16_MAX, _F16_MAX)
    hi = hi.clamp(-_F16_MAX, _F16_MAX)
    l16, h16 = lo.half(), hi.half()
    inf = torch.tensor(float("inf"), dtype=torch.float16, device=lo.device)
    l16 = torch.where(l16.float() > lo, torch.nextafter(l16, -inf), l16)
    h16 = torch.where(h16.float() < hi, torch.nextafter(h16, inf), h16)
    return l16, h16


def learned_thresholds(qz: ActivationQuantizer, x: torch.Tensor, dim: int, G: int, run_alpha, run_beta,
                       b: dict | None = None):
    """estimator="learned" (DESIGN.md, "Learned clipping"): this batch's ``(alpha, beta)`` =
    ``(hi - lo, lo)`` from the per-group thresholds ``lo = c - 2**t_lo``, ``hi = c + 2**t_hi``,
    then one Adam step on ``(t_lo, t_hi)`` against the expected squared error of the stored
    tensor, normalised by the squared range::

        E = mean[ 1{lo <= x <= hi} * step**2 / 6 + (x - hi)_+**2 + (lo - x)_+**2 ] / (hi - lo)**2

    (``step = (hi - lo) / L``: the rounding variance of unbiased stochastic rounding, averaged
    over the position inside a step; the other terms are the clipping error). ``c`` follows
    the group mean (EMA with the quantizer's ``decay``). The first call starts from the
    batch's min/max (``run_alpha``, ``run_beta``: the running estimate, first batch = its range).
    Only tensor ops (no host sync). ``b``: the buffers to read and step (``qz._state``), by
    default the quantizer's own."""
    b = qz._buffers if b is None else b
    if b["clip_center"].shape[0] != G:
        # num_groups above the grouped dim's size: G groups, kept in the buffers' first G entries
        # as the running estimates are (module doc)
        b = {**b, "clip_center": b["clip_center"][:G], **{n: b[n][:, :G] for n in ("clip_log", "clip_m", "clip_v")}}
    lam = qz.options.decay
    levels = float((1 << qz.options.bits) - 1)
    xf = x.float()
    group_sum, per_elem, n = _group_reducers(x, dim, G)
    mean = group_sum(xf) / n
    steps = b["clip_steps"]
    first = steps == 0
    # start: center = mid-range, distances = half range (the running min/max)
    mn0 = run_beta[0]
    half0 = (run_alpha[0] * 0.5).clamp_min(1e-12)
    c = torch.where(first, mn0 + half0, b["clip_center"] * lam + mean * (1.0 - lam))
    tl = torch.where(first, torch.log2(half0), b["clip_log"][0])
    th = torch.where(first, torch.log2(half0), b["clip_log"][1])
    dl, dh = torch.exp2(tl), torch.exp2(th)
    # a threshold beyond the running range clips nothing and only widens the step: use the
    # thresholds projected onto [min, max] (the objective, taken there, then pulls the log
    # distance back in). Unprojected, Adam's momentum could carry a softmax's lower threshold
    # below 0, and rows dequantized to a sum <= 0 broke the softmax backward's renormalisation.
    run_lo, run_hi = run_beta[0], run_beta[0] + run_alpha[0]
    lo = torch.maximum(c - dl, run_lo)
    hi = torch.minimum(c + dh, run_hi)
    inverted = ~(hi > lo)  # the center outside the running range (or a NaN): the range itself
    lo, hi = torch.where(inverted, run_lo, lo), torch.where(inverted, run_hi, hi)
    rng_ = (hi - lo).clamp_min(1e-12)
    step = rng_ / levels
    lo_e, hi_e = per_elem(lo), per_elem(hi)
    over = (xf - hi_e).clamp_min(0)
    under = (lo_e - xf).clamp_min(0)
    inside = ((over == 0) & (under == 0)).float()
    f_in = group_sum(inside) / n
    m_over, m_under = group_sum(over) / n, group_sum(under) / n
    ln2 = 0.6931471805599453
    var_term = f_in * step / (3.0 * levels) / qz.options.clip_horizon
    g_h = ln2 * dh * (var_term - 2.0 * m_over) / (rng_ * rng_)
    g_l = ln2 * dl * (var_term - 2.0 * m_under) / (rng_ * rng_)
    grad = torch.stack([g_l, g_h])
    _adam_step(b, torch.where(torch.isfinite(grad), grad, torch.zeros_like(grad)), tl, th, c)
    # quantize this batch with the thresholds the statistics were taken at
    alpha = torch.where(torch.isfinite(rng_), hi - lo, run_alpha[0]).view(1, G)
    beta = torch.where(torch.isfinite(lo), lo, run_beta[0]).view(1, G)
    return alpha.contiguous(), beta.contiguous()


def _group_reducers(x: torch.Tensor, dim: int, G: int):
    """``(group_sum, per_elem, n)`` for ``G`` groups of ``x``'s ``dim``: a per-element tensor
    summed into ``(G,)``, a ``(G,)`` tensor broadcast back to ``x``, and the elements a group."""
    D = x.shape[dim]
    gidx = [d * G // D for d in range(D)]
    counts = torch.tensor([gidx.count(g) for g in range(G)], dtype=torch.float32, device=x.device)
    n_per_d = x.numel() // max(D, 1)
    dims = [i for i in range(x.dim()) if i != dim]

    def group_sum(t):  # (S..) per element -> (G,)
        per_d = t.sum(dim=dims) if dims else t
        return torch.zeros(G, dtype=torch.float32, device=x.device).index_add_(
            0, torch.tensor(gidx, device=x.device), per_d)

    shape = [1] * x.dim()
    shape[dim] = D
    gi = torch.tensor(gidx, device=x.device)

    def per_elem(v):  # (G,) -> broadcastable to x
        return v[gi].view(shape)

    return group_sum, per_elem, counts * n_per_d


def _adam_step(b: dict, grad: torch.Tensor, tl: torch.Tensor, th: torch.Tensor, c: torch.Tensor) -> None:
    """One Adam step of the learned clipping's log distances ``(t_lo, t_hi)`` in the buffers
    ``b``, with the new center ``c``; nothing changes when a result is not finite."""
    steps = b["clip_steps"]
    b1, b2 = LEARNED_BETAS
    t = steps + 1
    m = b["clip_m"] * b1 + grad * (1 - b1)
    v = b["clip_v"] * b2 + grad * grad * (1 - b2)
    mhat = m / (1 - torch.pow(torch.full_like(t, b1), t))
    vhat = v / (1 - torch.pow(torch.full_like(t, b2), t))
    new_log = torch.stack([tl, th]) - LEARNED_LR * mhat / (torch.sqrt(vhat) + LEARNED_EPS)
    ok = torch.isfinite(new_log).all() & torch.isfinite(c).all()
    b["clip_log"].copy_(torch.where(ok, new_log, b["clip_log"]))
    b["clip_center"].copy_(torch.where(ok, c, b["clip_center"]))
    b["clip_m"].copy_(torch.where(ok, m, b["clip_m"]))
    b["clip_v"].copy_(torch.where(ok, v, b["clip_v"]))
    b["clip_steps"].copy_(torch.where(ok, t, steps))


def describe_record(rec) -> str:
    bits, scale, layout, learned = rec
    s = f"bits={bits}, scale={SCALES[scale] if 0 <= scale < len(SCALES) else scale}, "
    s += f"layout={LAYOUTS[layout] if 0 <= layout < len(LAYOUTS) else layout}"
    return s + (", estimator=learned" if learned else "")


def convert_format(state_dict: dict, *, bits: int = 8, scale: str = "linear", layout: str = "channel",
                   estimator: str = "running") -> dict:
    """A copy of ``state_dict`` whose quantizer entries load into a model patched with the
    given format: the running ranges (``alpha``/``beta``: range and minimum of the tensor,
    independent of the bit width) and the rng counter are kept, the format records are
    rewritten, learned-threshold state is dropped (it restarts from the running range) or,
    for ``estimator="learned"``, left to start from the running range."""
    rec = QuantOptions(bits=bits, scale=scale, layout=layout,
                       estimator=estimator).format_record
    out = {}
    prefixes = set()
    for k, v in state_dict.items():
        if k.endswith("." + FORMAT_KEY) or k == FORMAT_KEY:
            continue
        if any(k.endswith("." + n) or k == n for n in LEARNED_BUFFERS):
            continue
        out[k] = v
        if k.endswith(".rng") or k == "rng":
            prefixes.add(k[: -len("rng")])
    for p in prefixes:
        if rec != _DEFAULT_RECORD:
            out[p + FORMAT_KEY] = torch.tensor(rec, dtype=torch.int64)
    return out
