"""The recomputing backward of Mesa's fused attention, as a function (eager) and as an op
(``torch.compile``).

Mesa keeps q, k, v as 8-bit codes; backward dequantizes them, runs the stock
``F.scaled_dot_product_attention`` again on them with autograd enabled, and backpropagates
the output gradient through that call (``mesa_train/nn/sdpa.py`` explains why). Eager does
it in :func:`recompute_grads` (or in C++, ``csrc/sdpa_autograd.cpp``: the same steps).

Under ``torch.compile`` ``autograd.grad`` cannot be traced, so the compiled backward calls the
op ``mesa::sdpa_recompute_backward``, opaque to the compiler, which does the same at run time
(its kernel in C++, ``csrc/sdpa_autograd.cpp``, the one SdpaTrain's backward uses; the Python
kernel below where the extension lacks it).
Why an op rather than a traced kernel pair: the backend is then chosen at run time by the stock
dispatcher, exactly as for the stock model and for eager Mesa (cuDNN on an H100, flash or
memory-efficient elsewhere, the CPU flash kernel on CPU), masks and their gradients included.
The traced pair it replaces was always the memory-efficient kernels on CUDA: on an H100 they
took 5.6 ms a DeiT-S step where stock's compiled cuDNN pair took 2.7
(``results/modern/nvidia-h100-80gb-hbm3.profile.md``), and masked attention (Swin's windows,
BEiT's relative position bias) fell back to a float32 formula that materialised the map.
Compiled gradients are therefore eager Mesa's, bit for bit where the compiler runs the same
ops around the op (tests/test_compile_fullgraph.py).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from mesa_train.nn.quantizer import Packed, decompress

__all__ = ["DROPOUT_UNTRACEABLE", "DROPOUT_WHY", "attention", "build_window_mask", "capture_rng", "define_python_op",
           "grads_through", "operand_group_dim", "recompute_grads", "recompute_grads_compiled", "restore_operand"]

# Why a compressed attention call with dropout runs eagerly under torch.compile: the reason
# given to torch.compiler.disable, which Dynamo's graph-break message (under fullgraph=True,
# its error) names. compile_scope.compile_model refuses such a model before compiling.
DROPOUT_WHY = (
    "Mesa's attention replays its dropout mask in backward from the RNG state captured in forward, which Dynamo "
    "cannot trace, so each such call runs eagerly (a graph break). With fullgraph=True: set the attention dropout to "
    "0 (DeiT, Swin and PVT-v2 train with 0), compile with fullgraph=False (still compressed), or leave 'sdpa' out of "
    "the Mesa ops")
DROPOUT_UNTRACEABLE = f"mesa_train: attention dropout > 0 under torch.compile: {DROPOUT_WHY}"

_OP_NAME = "sdpa_recompute_backward"
_SCHEMA = (f"{_OP_NAME}(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? window_mask, "
           "bool is_causal, float? scale, bool[] output_mask, bool autocast, ScalarType? autocast_dtype) -> Tensor[]")


def operand_group_dim(x: torch.Tensor) -> int:
    """The dim an operand's quantization groups run along: heads of a ``(..., heads, L, E)``
    tensor, the last dim of a 3-D one."""
    return x.dim() - 3 if x.dim() >= 4 else x.dim() - 1


def restore_operand(codes, alpha, beta, dim, G, fmt, dtype):
    """Dequantize one operand the way every layer does (any format; traced under compile
    with traceable kernels), calling the kernel directly: the checking wrapper
    ``quant.dequantize`` cost ~3 us of Python per operand and backward."""
    return decompress(Packed(codes, alpha, beta, dim, G, fmt), dtype)


def build_window_mask(attn_mask: Optional[torch.Tensor], window_mask: Optional[torch.Tensor],
                      batch_windows: int, num_heads: int) -> Optional[torch.Tensor]:
    """The additive mask Swin hands to sdpa: ``attn_mask`` (broadcastable to
    ``(B*nW, heads, N, N)``) plus the ``(nW, N, N)`` window mask repeated over the batch
    (window ``w`` of image ``b`` is batch row ``b * nW + w``). Same arithmetic as timm."""
    if window_mask is None:
        return attn_mask
    num_win, N = window_mask.shape[0], window_mask.shape[-1]
    m = window_mask.view(1, num_win, 1, N, N).expand(batch_windows // num_win, -1, num_heads, -1, -1)
    m = m.reshape(-1, num_heads, N, N)
    return m if attn_mask is None else attn_mask + m


def attention(q, k, v, attn_mask, window_mask, dropout_p, is_causal, scale):
    """The stock call the layer makes, its two masks combined first."""
    mask = build_window_mask(attn_mask, window_mask, q.shape[0], q.shape[-3] if q.dim() >= 4 else 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale)


def recompute_grads(grad_out, q, k, v, attn_mask, window_mask, dropout_p, is_causal, scale,
                    needs: Sequence[bool], autocast, rng=None) -> tuple:
    """Gradients of the attention at ``(q, k, v)`` (and of a floating ``attn_mask``) by
    autograd through the stock call made again: ``needs`` says which of the four are wanted,
    the result has ``None`` for the others. ``autocast``: ``(device_type, enabled, dtype)`` of
    the forward; ``rng``: ``(cpu_state, device_state, device)`` to replay a dropout mask."""
    def call(q, k, v, attn_mask):
        return attention(q, k, v, attn_mask, window_mask, dropout_p, is_causal, scale)

    return grads_through(call, (q, k, v, attn_mask), needs, grad_out, autocast, rng)


def grads_through(call, inputs: Sequence, needs: Sequence[bool], grad_out, autocast, rng=None) -> tuple:
    """Gradients of ``call(*inputs)`` (its output receiving ``grad_out``) with respect to the
    inputs ``needs`` flags (``None`` for the others), the call made again with autograd on,
    in the forward's autocast state, and with its dropout mask replayed from ``rng``."""
    leaves = [t.detach().requires_grad_(bool(n)) if t is not None else None for t, n in zip(inputs, needs)]
    wanted = [t for t, n in zip(leaves, needs) if n]
    if not wanted:
        return (None,) * len(leaves)
    device_type, ac_enabled, ac_dtype = autocast
    with torch.enable_grad(), torch.autocast(device_type, dtype=ac_dtype, enabled=ac_enabled):
        if rng is not None:
            cpu_state, dev_state, device = rng
            devices = [device] if dev_state is not None else []
            with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
                torch.set_rng_state(cpu_state)
                if dev_state is not None:
                    torch.cuda.set_rng_state(dev_state, device)
                out = call(*leaves)
        else:
            out = call(*leaves)
        got = torch.autograd.grad(out, wanted, grad_out.to(out.dtype))
    return _per_input(got, needs)


def capture_rng(dropout_p: float, x: torch.Tensor):
    """The RNG state a dropout in the coming call draws from (``grads_through``'s ``rng``),
    or ``None`` without dropout."""
    if dropout_p <= 0.0:
        return None
    dev_state = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
    return torch.get_rng_state(), dev_state, x.device


def recompute_grads_compiled(grad_out, q, k, v, attn_mask, window_mask, is_causal, scale, needs: Sequence[bool],
                             autocast) -> tuple:
    """:func:`recompute_grads` inside a graph ``torch.compile`` traces (no dropout): the op
    ``mesa::sdpa_recompute_backward`` runs it at run time, since ``autograd.grad`` cannot be
    traced."""
    _, ac_enabled, ac_dtype = autocast
    got = torch.ops.mesa.sdpa_recompute_backward(grad_out, q, k, v, attn_mask, window_mask, is_causal, scale,
                                                 list(needs), ac_enabled, ac_dtype)
    return _per_input(got, needs)


def _per_input(got, needs: Sequence[bool]) -> tuple:
    """The gradients of the wanted inputs, in order, spread over all four (None for the rest)."""
    got = iter(got)
    return tuple(next(got) if n else None for n in needs)


_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                  torch._C.DispatchKey.AutogradNestedTensor, torch._C.DispatchKey.ADInplaceOrView)


def _autograd_reachable():
    """A context in which the ops called reach autograd again. A kernel runs with autograd
    excluded when a dispatch mode (PyTorch's opcheck, a FLOP counter, this project's op
    census) handed it the call: the mode's redispatch runs below autograd."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    if not excluded.has(torch._C.DispatchKey.AutogradFunctionality):
        return contextlib.nullcontext()
    for key in _AUTOGRAD_KEYS:
        excluded = excluded.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


def _check_output_mask(output_mask, attn_mask) -> None:
    if len(output_mask) != 4:
        raise ValueError(f"mesa::{_OP_NAME}: output_mask has one flag per input (q, k, v, attn_mask), "
                         f"got {len(output_mask)}")
    if output_mask[3] and (attn_mask is None or not attn_mask.is_floating_point()):
        raise ValueError(f"mesa::{_OP_NAME}: output_mask asks for the mask's gradient, but attn_mask is "
                         f"{'None' if attn_mask is None else attn_mask.dtype}; only a floating mask has one")


def _op_kernel(grad_out, q, k, v, attn_mask, window_mask, is_causal, scale, output_mask, autocast, autocast_dtype):
    _check_output_mask(output_mask, attn_mask)
    with _autograd_reachable():
        grads = recompute_grads(grad_out, q, k, v, attn_mask, window_mask, 0.0, is_causal, scale, output_mask,
                                (q.device.type, autocast, autocast_dtype))
    # contiguous, as the fake kernel states: compiled code reads the results with its strides
    return [g.contiguous() for g in grads if g is not None]


def _op_fake(grad_out, q, k, v, attn_mask, window_mask, is_causal, scale, output_mask, autocast, autocast_dtype):
    _check_output_mask(output_mask, attn_mask)
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device)
            for t, n in zip((q, k, v, attn_mask), output_mask) if n]


def define_python_op(lib) -> None:
    """The op, with the Python kernel, in ``lib``'s namespace (``mesa`` without the extension's
    C++ kernel; the bench times it beside that one under a namespace of its own)."""
    lib.define(_SCHEMA)
    lib.impl(_OP_NAME, _op_kernel, "CompositeExplicitAutograd")
    # The kernel runs autograd itself: the dispatcher must reach it with autograd still on (a
    # fallthrough sets no below-autograd guard). Its results carry no graph: the op is a
    # backward, never differentiated.
    lib.impl(_OP_NAME, torch.library.fallthrough_kernel, "Autograd")


def _register() -> None:
    """The op's fake kernel, and the op itself in Python where the extension lacks it (a build
    from before the C++ kernel, ``csrc/sdpa_autograd.cpp``, or none): the same steps, at about
    three times the host time a call."""
    if getattr(torch.ops.mesa, "_mesa_sdpa_backward_registered", False):  # (a reloaded module)
        return
    lib = torch.library.Library("mesa", "FRAGMENT")
    if not hasattr(torch.ops.mesa, _OP_NAME):
        define_python_op(lib)
    torch.library.register_fake(f"mesa::{_OP_NAME}", _op_fake, lib=lib)
    _LIBS.append(lib)
    torch.ops.mesa._mesa_sdpa_backward_registered = True


_LIBS: list = []  # the Library object owns the registrations: kept alive
_register()
