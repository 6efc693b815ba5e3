"""The ``mesa`` ops in plain, trace-friendly PyTorch: the path ``torch.compile`` sees.

Eager training calls the C++/CUDA ops (``torch.ops.mesa.observe`` / ``quantize`` /
``dequantize``: two launches per compression in forward, one in backward). Inside
``torch.compile`` an opaque extension call would stop Inductor from fusing the compression
into the kernels around it, so :class:`mesa_train.nn.ActivationQuantizer` calls these
functions instead. They compute exactly the arithmetic of ``docs/DESIGN.md`` ("Quantization
ops"), bit for bit the same as the kernels when run eagerly (``tests/test_traceable.py``),
with only static shapes and no host synchronisation:

* group boundaries are Python constants (no ``bincount``), so every shape is static;
* the stochastic-rounding seed is a device tensor (``[seed_lo, seed_hi]``) derived from the
  quantizer's ``rng = [key, counter]`` buffer, never a Python int, so one graph serves every
  step and CUDA graphs can replay it;
* estimate buffers are updated with in-place ``copy_`` (functionalised by the compiler).

Under Inductor the floating-point results may differ from the kernels in the last bit where
the compiler contracts a multiply-add; on a GPU also where Triton divides (``x / y`` is
``div.full.f32``, within 2 ulp, unless Inductor's ``eager_numerics.division_rounding``: the
quantize's ``255 / alpha``) and where Inductor turns a division by a constant into a multiply
by its reciprocal (dequantize's ``alpha / 255``, whose ``full_like`` it folds: 70% of random
float32 ``alpha`` then round differently; ``torch/_inductor/lowering.py``, ``div_prim``, which
spares the CPU). So a code may differ where its value lies within an ulp of a rounding step.
The layers' forward outputs never depend on them; gradients are close, not bitwise, to eager's
on a GPU (``scripts/inductor_gpu_code.py`` shows the generated code).
"""
from __future__ import annotations

import torch

# canonical, seed_step and softmax_backward_from_y are the reference's own: already tensor-only
from .reference import canonical, layer_norm_backward_from_xh, seed_step, softmax_backward_from_y, unscale_rows

__all__ = ["group_minmax", "observe", "quantize_observe", "seed_step", "quantize", "dequantize", "canonical",
           "softmax_backward", "round_through", "stored_here"]

_EPS = 1e-12


def stored_here(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself (an identity view), which Inductor writes to a buffer of its own at this
    point of the graph: its ``as_strided`` lowering realizes the input in place, so every
    consumer lowered after it reads the stored values.

    Why: Inductor inlines an unstored pointwise value into each consumer lowered before
    whatever stores it. A softmax's map is stored by the ``attn @ v`` matmul after the Mesa
    Softmax, so its compression (the row segments' min/max, then the codes a kernel later)
    recomputed the map from the logits and the row statistics: the running estimator's coding
    kernel ran 124 instructions an element on sm_90 against the delayed one-pass kernel's 73
    (``scripts/triton_sass.py``). Stored first, the same bytes move (the map is written once
    either way, by the softmax's kernel instead of the coding one) and the codes are made from
    the stored bf16 map. Inductor gives an ``as_strided`` input exactly its eager strides: the
    map's head stride is 197 * 197 elements, not the 197 * 197 + 39 its padding would choose."""
    return t.as_strided(t.size(), t.stride())  # (the storage offset defaults to t's own)


def _group_blocks(D: int, G: int) -> list[list[int]]:
    """Indices ``d`` of each group (``g = d * G // D``), padded to one length by repeating
    the group's last index (a repeat changes neither min nor max)."""
    starts = [-(-g * D // G) for g in range(G)] + [D]
    L = max(starts[g + 1] - starts[g] for g in range(G))
    return [[min(starts[g] + j, starts[g + 1] - 1) for j in range(L)] for g in range(G)]


def _per_d_minmax(mins: torch.Tensor, maxs: torch.Tensor, dim: int, S: int):
    """Min of ``mins`` and max of ``maxs`` over everything but (sample, d): float32 ``(S, D)``."""
    outer = 1
    for s in mins.shape[:dim]:
        outer *= s
    D = mins.shape[dim]
    inner = mins.numel() // max(outer * D, 1)
    if S == 1:
        return (mins.reshape(outer, D, inner).amin(dim=(0, 2)).float().view(1, D),
                maxs.reshape(outer, D, inner).amax(dim=(0, 2)).float().view(1, D))
    if dim > 0:
        return (mins.reshape(S, outer // S, D, inner).amin(dim=(1, 3)).float(),
                maxs.reshape(S, outer // S, D, inner).amax(dim=(1, 3)).float())
    # per sample over dim 0: sample s is exactly index d = s, other samples' cells are empty
    eye = torch.eye(D, dtype=torch.bool, device=mins.device)
    inf = torch.full((D, D), float("inf"), dtype=torch.float32, device=mins.device)
    dmn = torch.where(eye, mins.reshape(D, inner).amin(dim=1).float().view(1, D).expand(D, D), inf)
    dmx = torch.where(eye, maxs.reshape(D, inner).amax(dim=1).float().view(1, D).expand(D, D), -inf)
    return dmn, dmx


def _row_segments_minmax(x: torch.Tensor, dim: int, G: int):
    """Stage 1 of :func:`group_minmax`: min and max over ``x``'s last dim in segments that lie
    in one group (the whole last dim when the groups run along an earlier dim; one group's
    ``D / G`` channels when they run along the last), the grouped dim kept (size ``G`` in the
    second case). ``None`` where no such split exists (groups of unequal size along the last
    dim, or the grouped dim is the only one).

    Why two stages: a min/max over the contiguous last dim is the reduction Inductor fuses into
    the kernel that produces ``x`` (a softmax's or a pointwise producer's rows, and the traced
    quantize of the same elements), where the one-stage form (over every dim but ``dim`` at
    once: a column reduction) became a split reduction of three kernels reading ``x`` again
    (seen in Inductor's CUDA code for a DeiT-S block, ``scripts/inductor_gpu_code.py``). The
    second stage reads ``1 / len(segment)`` of ``x``. Same bits: a min or max is exact whatever
    the order, and the result is made canonical (NaN, signed zero) after both stages."""
    last = x.dim() - 1
    if last == 0:
        return None
    if dim < last:
        return x.amin(dim=-1), x.amax(dim=-1)
    D = x.shape[-1]
    if D % G != 0:
        return None
    xv = x.reshape(*x.shape[:-1], G, D // G)
    return xv.amin(dim=-1), xv.amax(dim=-1)


def group_minmax(x: torch.Tensor, dim: int, num_groups: int, per_sample: bool = False):
    """Per-group ``(min, max)``, float32 ``(S, G)``, canonical bits; ``x`` contiguous."""
    S = x.shape[0] if per_sample else 1
    G = num_groups
    if x.numel() == 0:
        mn = torch.full((S, G), float("inf"), dtype=torch.float32, device=x.device)
        return mn, -mn
    segments = _row_segments_minmax(x, dim, G)
    if segments is not None and dim == x.dim() - 1:  # one cell per (row, group): the groups are done
        dmn, dmx = _per_d_minmax(segments[0], segments[1], dim, S)
        return canonical(dmn), canonical(dmx)
    dmn, dmx = _per_d_minmax(*(segments if segments is not None else (x, x)), dim, S)
    D = x.shape[dim]
    if D % G == 0:  # equal blocks: a reshape, no gather
        mn = dmn.view(S, G, D // G).amin(dim=2)
        mx = dmx.view(S, G, D // G).amax(dim=2)
    else:
        idx = torch.tensor(_group_blocks(D, G), dtype=torch.int64, device=x.device)
        mn = dmn[:, idx].amin(dim=2)
        mx = dmx[:, idx].amax(dim=2)
    return canonical(mn), canonical(mx)


def _segment_cells(x: torch.Tensor, dim: int, G: int):
    """``(cells, cells_dim)``: :func:`_row_segments_minmax`'s minima and maxima stacked into one
    tensor ``(2, ...)`` (x's dtype, the grouped dim at ``cells_dim``), whose per-group min and
    max are ``x``'s (every segment's max is at least its min, NaN propagates either way): the
    input the extension's reduction ops finish in one launch. ``None`` where stage 1 does not
    apply (see there) or ``x`` is empty."""
    segments = _row_segments_minmax(x, dim, G) if x.numel() > 0 else None
    if segments is None:
        return None
    return torch.stack(segments), min(dim, x.dim() - 1) + 1


def observe(x, alpha_est, beta_est, initialized, rng, dim: int, num_groups: int, decay: float,
            per_sample: bool, symmetric: bool):
    """``mesa::observe``: batch min/max, running-estimate step, seed step (one op when eager).

    Traced: the min/max of each row segment (:func:`_row_segments_minmax`, which Inductor fuses
    into the kernel producing ``x``), then ``mesa::observe`` itself on those cells, one opaque
    launch for the rest of the reduction, the estimate step and the seed step: on the GPU the
    traced remainder was four Triton kernels (a split reduction each for min and max, the last
    with the estimate arithmetic), each a launch on a few hundred KB. Per-sample statistics and
    layouts without a segment split keep the traced min/max and ``mesa::estimate_and_seed``
    (the estimate and seed steps as one op: traced they were about 150 graph nodes per
    compression, 64% of the traced compression's nodes, for nothing to fuse, and they made
    compiling a whole model slow, DeiT-S on an H100: not done in 6 minutes)."""
    cells = None if per_sample else _segment_cells(x, dim, num_groups)
    if cells is not None:
        return torch.ops.mesa.observe.default(cells[0], alpha_est, beta_est, initialized, rng, cells[1], num_groups,
                                              float(decay), False, bool(symmetric))
    mn, mx = group_minmax(x, dim, num_groups, per_sample)
    return torch.ops.mesa.estimate_and_seed.default(mn, mx, alpha_est, beta_est, initialized, rng, float(decay),
                                                    bool(per_sample), bool(symmetric), x.numel() > 0)


def quantize_observe(x, alpha_est, beta_est, initialized, rng, dim: int, num_groups: int, decay: float,
                     symmetric: bool, stochastic: bool, ready: bool = False):
    """``mesa::quantize_observe`` (estimator ``"delayed"``) under ``torch.compile``.

    ``ready`` (the host knows the estimates are initialized, see
    ``mesa_train.nn.quantizer.mark_estimates_ready``): the codes traced, depending on the
    activation, the estimate buffers as they stand and the seed only, so Inductor generates one
    kernel for the producer of ``x``, its row segments' min/max and its codes (one pass). Two
    opaque launches around it: ``mesa::seed_of`` before (the seed the seed step would draw, rng
    unchanged; traced, its three chained hashes were inlined into every use and the lowering
    grew exponentially), ``mesa::delayed_observe`` after, on those cells (1/64 of a token
    tensor; on ``x`` itself where no segment split exists): copies of the estimates the codes
    used (what backward dequantizes with: an op's output, not a traced clone of the buffers,
    which the min-cut partitioner may recompute in backward from buffers this forward has
    updated since: measured, gradients ~1e-6 off), then the estimate update and the counter's
    step. (Before: ``mesa::estimate_and_seed`` on empty statistics, whose fill was a kernel of
    its own, then ``mesa::group_minmax`` and ``mesa::update_estimates``: three ops.) Not ready:
    the op itself, opaque (whether the estimates are initialized is known on the device only;
    two passes, as ``running``)."""
    G = num_groups
    if not ready:
        return torch.ops.mesa.quantize_observe.default(x, alpha_est, beta_est, initialized, rng, dim, G,
                                                       float(decay), bool(symmetric), bool(stochastic))
    seed = torch.ops.mesa.seed_of.default(rng)
    q = quantize(x, alpha_est[:G].view(1, G), beta_est[:G].view(1, G), dim, G, stochastic, seed)
    cells = _segment_cells(x, dim, G)
    stats, stats_dim = cells if cells is not None else (x, dim)
    old_a, old_b = torch.ops.mesa.delayed_observe.default(stats, alpha_est, beta_est, initialized, rng, stats_dim, G,
                                                          float(decay), bool(symmetric))
    return q, old_a, old_b


def _per_element(t: torch.Tensor, params, dim: int, G: int):
    """Broadcast each ``(S, G)`` param to ``t``'s shape (per element) without reshaping
    ``t`` itself: the results are fresh tensors of ``t``'s shape, never views of it (an
    output aliasing an input cannot leave a compiled autograd.Function)."""
    D = t.shape[dim]
    S = params[0].shape[0]
    if D % G == 0:
        per_d = [p.repeat_interleave(D // G, dim=1) for p in params]  # (S, D)
    else:
        gidx = torch.tensor([d * G // D for d in range(D)], dtype=torch.int64, device=t.device)
        per_d = [p[:, gidx] for p in params]
    shape = [1] * t.dim()
    shape[dim] = D
    if S == 1:
        return [p.view(shape) for p in per_d]
    if dim > 0:  # per sample: S = t.shape[0]
        shape[0] = S
        return [p.view(shape) for p in per_d]
    # per sample over dim 0: sample s is index d = s
    ar = torch.arange(D, device=t.device)
    return [p[ar, ar].view(shape) for p in per_d]


def _lowbias32_i32(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` on int32 tensors: the same 32 bits as the reference's int64 version.

    Why int32: the reference emulates a 32-bit multiply modulo 2**32 in int64 (``_mul32``:
    three multiplies, shifts and masks per product). Inductor's C++ backend takes about 4x
    longer to compile that (about 13 s against 3 s per quantize kernel on a 2-core CPU) and
    runs more instructions. An int32 multiply wraps modulo 2**32 on every backend (ATen CPU
    and CUDA, Inductor's C++ vector code, Triton), and its bits are the uint32 product's.
    ``>>`` on int32 is arithmetic, so each right shift is masked to make it logical.
    """
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * (0x846CA68B - (1 << 32))  # the constant's bits as a signed int32
    x = x ^ ((x >> 16) & 0xFFFF)
    return x


def _as_int32_bits(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same low 32 bits (no overflowing cast).

    Flipping bit 31 and subtracting it maps [0, 2**31) to itself and [2**31, 2**32) to
    [-2**31, 0): ``words`` is read once. (``where(words >= 2**31, words - 2**32, words)``, the
    same values, reads it three times, and Inductor traces an unrealized input once per read:
    see ``_uniform``.)"""
    return ((words ^ (1 << 31)) - (1 << 31)).to(torch.int32)


def _uniform(numel: int, seed: torch.Tensor, device) -> torch.Tensor:
    """The DESIGN.md counter hash for flat indices ``0 .. numel`` (``numel < 2**31``: the
    index's high word is 0, so its term vanishes), computed in int32 (see ``_lowbias32_i32``).

    Written so that each value is read once where it can be: Inductor does not realize these
    small pointwise steps (``realize_opcount_threshold`` 128 for traced models), and traces
    each step once per read of it, so a value read twice by each of the three xor-shifts of
    ``lowbias32`` is traced 8 times, and the key inside the Weyl step 8 times that. The
    runtime zero below took the key twice more (``key ^ key``), and the seed words'
    conversion read each three times. With ``s0 ^ s0`` and the single-read ``_as_int32_bits``:
    the same values and, but for that xor's operand, the same kernels, and the fake-H100
    census of a traced GELU 48 -> 20 s (``docs/DESIGN.md``;
    ``tests/test_traceable.py::test_traced_hash_graph_unfolds_to_a_bounded_tree``)."""
    s = _as_int32_bits(seed & 0xFFFFFFFF)
    s0 = s[0]
    key = _lowbias32_i32(s0 ^ _lowbias32_i32(s[1]))  # hash_key with index_hi = 0: one per call
    # + (s0 ^ s0), a runtime zero: Inductor folds arange * constant into its index
    # arithmetic, and over a permuted view Triton's codegen then emitted a stride product past
    # int32 ('Scalar -5354694904128 is out of range for type int32', torch 2.11, H200); a value
    # loaded from a tensor keeps the Weyl product in value space, where int32 wraps
    i = torch.arange(numel, dtype=torch.int32, device=device) + (s0 ^ s0)
    h = _lowbias32_i32((i >> 1) * (0x9E3779B9 - (1 << 32)) + key)  # the pair's Weyl step; int32 wraps
    # the element's half of its pair's hash (even: low 16 bits, odd: high): each element hashes
    # its pair again (Inductor computes elements apart), the same values as the kernels' one a pair
    return ((h >> ((i & 1) << 4)) & 0xFFFF).to(torch.float32) * (2.0**-16)


def _clamp_codes(v: torch.Tensor, top: float) -> torch.Tensor:
    """NaN -> 0, then clamp to ``[0, top]``: two compare-selects, the same values as
    ``where(isnan(v), 0, v).clamp(0, top)`` (a NaN fails ``v >= 0``; -0.0 stays -0.0 and
    converts to code 0). Why not ``isnan``: Inductor's C++ backend has no vector ``isnan``
    and falls back to a scalar loop over each 16-lane vector, which made the compiled
    quantize 4.6x slower than with these compares (287 vs 62 us on a (544, 384) fp32
    tensor, nearest rounding, one thread)."""
    v = torch.where(v >= 0.0, v, torch.zeros((), dtype=v.dtype, device=v.device))
    return torch.where(v <= top, v, torch.full((), top, dtype=v.dtype, device=v.device))


def quantize(x, alpha, beta, dim: int, num_groups: int, stochastic: bool, seed: torch.Tensor):
    """uint8 codes of contiguous ``x`` (DESIGN.md arithmetic); ``seed`` = ``[lo, hi]`` tensor."""
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if x.numel() >= 2**31:
        raise ValueError("the traceable quantize handles tensors of fewer than 2**31 elements")
    inv = torch.where(alpha > _EPS, torch.full_like(alpha, 255.0) / alpha, torch.zeros_like(alpha))
    inv, b = _per_element(x, [inv, beta], dim, num_groups)
    v = (x.to(torch.float32) - b) * inv
    if stochastic:
        # floor(v + u), clamped: the uint8 cast truncates what the clamp leaves in [0, 255], and
        # truncating is floor there, so no floor (one instruction an element fewer on a GPU,
        # FRND, in kernels bound by their instructions; the same codes: tests/test_traceable.py)
        v = v + _uniform(x.numel(), seed, x.device).view(x.shape)
    else:
        v = torch.round(v)  # half to even
    return _clamp_codes(v, 255.0).to(torch.uint8)


def dequantize(q, alpha, beta, dim: int, num_groups: int, dtype: torch.dtype):
    """``q * (alpha / 255) + beta`` in fp32 (step, product, sum rounded separately)."""
    if q.numel() == 0:
        return torch.empty(q.shape, dtype=dtype, device=q.device)
    step = alpha / torch.full_like(alpha, 255.0)
    st, b = _per_element(q, [step, beta], dim, num_groups)
    return ((q.to(torch.float32) * st) + b).to(dtype)


# ----------------------------------------------------------------------------- variants
# ``mesa::quantize_bits`` / ``mesa::dequantize_bits`` (DESIGN.md, "Variants") in plain
# PyTorch, bit for bit the ops when run eagerly (tests/test_variants.py).
def _step_and_inv(alpha, bits: int, pow2: bool):
    from .reference import step_and_inv

    return step_and_inv(alpha, bits, pow2)


def _pack(c: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    c = c.reshape(-1)
    if per == 1:
        return c
    n = c.numel()
    nb = -(-n // per)
    c = torch.nn.functional.pad(c.to(torch.int32), (0, nb * per - n))
    shifts = torch.arange(per, dtype=torch.int32, device=c.device) * bits
    return (c.view(nb, per) << shifts).sum(1, dtype=torch.int32).to(torch.uint8)


def _unpack(p: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return p[:numel]
    shifts = torch.arange(per, dtype=torch.int32, device=p.device) * bits
    c = (p.to(torch.int32).view(-1, 1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(-1)[:numel]


def quantize_bits(x, alpha, beta, dim: int, num_groups: int, bits: int, pow2: bool, stochastic: bool,
                  seed: torch.Tensor):
    """Packed ``bits``-bit codes (1-d uint8) of contiguous ``x``; ``mesa::quantize_bits``."""
    if x.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    if x.numel() >= 2**32:
        raise ValueError("the traceable quantize handles tensors of fewer than 2**32 elements")
    _, inv = _step_and_inv(alpha, bits, pow2)
    inv, b = _per_element(x, [inv, beta], dim, num_groups)
    v = (x.to(torch.float32) - b) * inv
    if stochastic:
        v = v + _uniform(x.numel(), seed, x.device).view(x.shape)  # (no floor: see quantize)
    else:
        v = torch.round(v)
    v = _clamp_codes(v, float((1 << bits) - 1))
    q = _pack(v.to(torch.uint8), bits)
    return q.clone() if bits == 8 else q  # never a view of an intermediate's storage


def dequantize_bits(q, alpha, beta, shape, dim: int, num_groups: int, bits: int, pow2: bool, dtype):
    """``q * step + beta`` (fp32, rounded separately) of ``shape``; ``mesa::dequantize_bits``."""
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=q.device)
    c = _unpack(q, bits, numel).reshape(shape)
    step, _ = _step_and_inv(alpha, bits, pow2)
    st, b = _per_element(c, [step, beta], dim % len(shape), num_groups)
    return ((c.to(torch.float32) * st) + b).to(dtype)


# ----------------------------------------------------------------------------- softmax backward
_F16_MAX_EXACT = 65520.0  # |v| >= this rounds (to nearest even) to inf in float16
_F16_MIN_NORMAL = 2.0 ** -14


def _keep_low_bits(v: torch.Tensor, drop: int) -> torch.Tensor:
    """Float32 ``v`` rounded to nearest even at bit ``drop`` of its significand, by integer
    arithmetic on its bits (finite ``v``; a carry into the exponent is the correct result)."""
    u = v.view(torch.int32)
    half = (1 << (drop - 1)) - 1
    r = (u + half + ((u >> drop) & 1)) & -(1 << drop)
    return r.view(torch.float32)


def round_through(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``v.to(dtype).to(torch.float32)`` for float32 ``v``, in a form Inductor cannot skip: it
    computes a fused kernel's bfloat16 / float16 intermediates in float32 and drops such a
    round trip (unless ``emulate_precision_casts``), so the rounding is written out as float32
    bit arithmetic. NaN stays NaN (its payload aside)."""
    if dtype == torch.float32:
        return v
    if dtype == torch.bfloat16:
        return torch.where(v != v, v, _keep_low_bits(v, 16))
    a = v.abs()
    normal = _keep_low_bits(a, 13)
    # below float16's normals the grid is 2**-24: rint(a * 2**24) * 2**-24, the rint as the
    # exact float trick (c + 2**23) - 2**23 (c < 2**10); the scalings are exact powers of two
    c = a * torch.full_like(a, 2.0 ** 24)
    big = torch.full_like(a, 2.0 ** 23)
    sub = ((c + big) - big) * torch.full_like(a, 2.0 ** -24)
    r = torch.where(a < _F16_MIN_NORMAL, sub, normal)
    r = torch.where(a >= _F16_MAX_EXACT, torch.full_like(a, float("inf")), r)
    return torch.where(v != v, v, torch.copysign(r, v))


def softmax_backward(g, q, alpha, beta, dim: int, num_groups: int, y_dtype=None, out_dtype=None):
    """``mesa::softmax_backward`` (the reference's arithmetic without its argument checks):
    the lane sums are a static unrolled loop of adds and five butterfly steps, every
    division is tensor / tensor, which Inductor keeps a division, and y's rounding to the
    map's dtype (``y_dtype``, default g's) is explicit (:func:`round_through`);
    tests/test_softmax_backward.py pins the compiled form to the op's bits."""
    result = g.dtype if out_dtype is None else out_dtype
    if q.numel() == 0:
        return torch.empty(q.shape, dtype=result, device=q.device)
    map_dtype = g.dtype if y_dtype is None else y_dtype
    y = round_through(dequantize(q, alpha, beta, dim, num_groups, torch.float32), map_dtype)
    return softmax_backward_from_y(y, g, result)


def layer_norm_backward(g, q, alpha, beta, num_groups: int, rstd, weight=None, row_exp=None):
    """``mesa::layer_norm_backward`` (the reference's arithmetic without its argument checks):
    x_hat dequantized to float32 with its row exponents undone, then the same tensor ops (lane
    sums as unrolled adds and butterfly steps, tensor / tensor divisions, column sums in their
    chunk and block order, then a sum over the blocks). Under aot_eager these are the op's bits
    (tests/test_compile_kernels.py); Inductor may fuse them into other roundings."""
    xh = unscale_rows(dequantize(q, alpha, beta, q.dim() - 1, num_groups, torch.float32), row_exp)
    return layer_norm_backward_from_xh(xh, g, rstd, weight)
