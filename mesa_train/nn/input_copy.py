"""One compressed copy of a tensor that several Mesa convs, or several Mesa Linears, take as input.

Stock autograd keeps one tensor however many layers save it: the branches of a RepVGG or
MobileOne block (a k x k conv, a 1 x 1 conv, MobileOne's over-parameterised k x k copies), an
Inception module's branch heads, a ResNet block's ``conv1`` and ``downsample`` all save the same
``x``; so do separate q / k / v projections of one normed input (HF-style attention, EVA with
``qkv_fused=False``, ``nn.MultiheadAttention``'s self-attention). Each Mesa layer compressing it
alone kept one 8-bit copy per consumer: ``mobileone_s0`` kept six of each block input where
stock keeps one fp32 tensor (0.53x of stock's bytes).

Here the first Mesa layer that compresses ``x`` leaves its codes on the tensor object, and a
later one given the same object, unmodified since (``x._version``) and compressing it alike
(its ``signature``: the same kind of layer and path, C++ op or Python Function, equal
:class:`~mesa_train.nn.quantizer.QuantOptions`, and what else decides the codes: a conv's
spatial dims, a Linear's weight dtype and autocast state), saves those codes instead of making
its own. Any valid copy of ``x`` serves a weight gradient; the consumers' stochastic rounding is
then shared (each gradient stays unbiased). The consumer's quantizer takes no batch into its
estimates while it reads another's copy; its state is the producer's business.

Why an attribute of the tensor and not a cache keyed by its memory (``sharing.py``): the
consumers are handed the very same Python object (``self.conv_kxk(x)``, ``self.conv_1x1(x)``),
the lookup is one attribute read (a miss is the common case: most layers are the only
consumer), and the codes live as long as ``x``'s Python object: in training an intermediate dies with
its graph, as stock's saved ``x`` does, but one a caller keeps past backward (features held for
the next step) keeps its 8-bit copy too. Changes autograd does not see (``x.data = ...``,
``x.data.mul_(...)``) do not change ``x._version``: a later layer would save the codes of the
old values, as such changes leave autograd's own saved tensors stale.

Only a tensor computed with gradients (not a leaf) takes codes: it is a new object every
forward, so codes are never carried into the next step or into another model's forward. A
leaf, as a batch of images reused for several steps or handed to two models, would hand the
first step's codes on: the same rounding noise every step (no longer averaging out) and a
quantizer that never takes a batch.

Nothing is shared inside a non-reentrant activation checkpoint, in its first pass or in its
recomputation: the two passes must make the same calls (selective checkpointing replays the
first pass's cached ops in order, and a recomputation that took a copy where the first pass
made one handed the next layer another tensor's codes), and codes left on the segment's input
in the first pass would outlive the saved tensors the checkpoint drops. Eager only: under
``torch.compile`` (``sharing.is_enabled``) each layer compresses its own copy, as before, and so
within :func:`sharing.disabled`.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from . import sharing
from .checkpoint_phase import checkpoint_phase

__all__ = ["may_share", "take", "offer", "take_or_make", "disabled", "conv_op_signature", "conv_function_signature",
           "ATTRIBUTE", "READ_ANOTHERS"]

ATTRIBUTE = "_mesa_input_copy"
# set on a quantizer whose layer saved another layer's codes (describe: not "uninitialized")
READ_ANOTHERS = "reads_parallel_copy"


class _Local(threading.local):
    off = 0  # (a class default: an unset thread's read finds it instead of raising inside getattr)


_local = _Local()


@contextlib.contextmanager
def disabled():
    """Every layer compresses its own copy in this thread, as under ``torch.compile``: an eager
    run that is a compiled run's twin bit for bit (``sharing.disabled`` also turns off the
    Softmax -> MatMul hand-over, which the compiled attention keeps)."""
    _local.off += 1
    try:
        yield
    finally:
        _local.off -= 1


def may_share(x: torch.Tensor) -> bool:
    """Whether ``x`` may take or carry codes now: a tensor this forward computed (not a leaf; a
    ``detach_()`` makes a leaf of a tensor with codes without a new version, as truncated
    backprop through time does with a carried state: its codes would be last step's), eager
    with sharing on, and not inside an activation checkpoint (see the module doc). A layer asks
    once per call and builds its ``signature`` only then: most layers are the only consumer of
    their input, and this is the host time every one of them pays."""
    return not _local.off and sharing.is_enabled() and not x.is_leaf and not checkpoint_phase()


def conv_op_signature(spatial_dims: int, options) -> tuple:
    """The signature of codes a conv's C++ layer op (``mesa::conv2d_train`` / ``conv1d_train``)
    takes: its spatial dims and its quantizer's options. An identity-branch BatchNorm offers its
    codes of x under it too (``batchnorm._offer_input``)."""
    return ("op", spatial_dims, options)


def conv_function_signature(spatial_dims: int, options) -> tuple:
    """:func:`conv_op_signature` for the convs' Python Function (``conv.conv_forward``), whose
    codes are a ``Packed`` (``batchnorm.bn_forward`` offers under it on that path)."""
    return ("function", spatial_dims, options)


def take(x: torch.Tensor, signature: tuple, quantizer):
    """The codes a layer compressing alike (``signature``) left on ``x``, if ``x`` is unchanged
    since; else ``None``. Only where :func:`may_share` said yes. ``quantizer``: the taking
    layer's, marked when it takes."""
    entry = getattr(x, ATTRIBUTE, None)
    if entry is None or entry[0] != x._version or entry[1] != signature:
        return None
    quantizer.__dict__[READ_ANOTHERS] = True  # (a plain attribute: nn.Module.__setattr__ is slow)
    return entry[2]


def offer(x: torch.Tensor, signature: tuple, codes) -> None:
    """Leave ``codes`` (made from ``x`` as it is now) on ``x`` for the next layer compressing
    alike. Only where :func:`may_share` said yes."""
    setattr(x, ATTRIBUTE, (x._version, signature, codes))


def take_or_make(x: torch.Tensor, signature: tuple | None, quantizer, make):
    """The Python Functions' form: the codes another layer left on ``x`` (``take``), else
    ``make()``'s, left for the next (``offer``); ``signature`` None (:func:`may_share` said no,
    or the layer keeps its own copy): ``make()``'s, not shared."""
    if signature is None:
        return make()
    codes = take(x, signature, quantizer)
    if codes is None:
        codes = make()
        offer(x, signature, codes)
    return codes
