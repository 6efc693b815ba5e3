"""Keep the codes, not their dequantized values, for backward (traced compression under
``torch.compile``).

With ``compile_kernels=traceable`` the dequantize of a compressed activation is plain PyTorch
inside a backward, and AOTAutograd's partitioner treats every node of the joint graph that
does not depend on an output gradient as one it may compute in the forward and save. Its
min-cut prefers the one-byte codes, except where a dequantized value feeds a kernel Inductor
cannot fuse it into (a matmul, the fused attention's backward): there it bans recomputing the
value in backward ("materialized in backward") and saves the dequantized bf16 tensor instead,
computed in the forward. A DeiT-S block then kept q, k^T, v and the attention output as bf16
copies: 2.4 MB more per block at batch 8 than the ops path (15.1 against 12.7 MB saved;
``results/inductor-gpu-code/``), the traced rows' higher peak on the H100 (0.47x of stock
against 0.38x with the ops).

:class:`SaveCodes` is an Inductor joint-graph pass (``joint_custom_post_pass``, in
``mesa_train.compile_scope.TRACED_INDUCTOR_OPTIONS``) that marks each such dequantize chain
``MUST_RECOMPUTE`` and its codes ``MUST_SAVE`` (the policy tags of selective activation
checkpointing, which the partitioner honours): the chain starts where a uint8 tensor becomes
a floating one and runs through pointwise ops and views up to its consumers. A chain is left
alone where recomputing it would cost more than it saves: one of its consumers does not
depend on an output gradient (a forward use), or one of its other inputs is a large tensor
that the graph would then have to save (more than a quarter of the codes' bytes, and not a
graph input, which costs nothing to keep).

A tagged chain's small inputs are computed for it alone: the dequantize step ``alpha / 255``
and its views. Untagged, the partitioner computes them in the forward and saves the result
(the same bytes as saving ``alpha``): one tiny kernel launch per compression in the forward
(five a DeiT-S block, about 2.5 us each on a GPU; ``results/triton-sass/``). The pass tags
them ``MUST_RECOMPUTE`` as well, up to the first node with another use or that is not a small
floating pointwise op or view (the estimate, a reduction, an integer row exponent), so the
backward's dequantize kernel computes the step from the saved estimate itself.
"""
from __future__ import annotations

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["SaveCodes", "mark_dequantize_for_backward"]

_COPIES = (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten._unsafe_view.default)


def _value(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _nbytes(node) -> int:
    v = _value(node)
    return v.numel() * v.element_size() if v is not None else 0


def _elementwise(node: fx.Node) -> bool:
    """A pointwise op, a view or a copy: what Inductor fuses into the consumer's kernel."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in t.tags or t.is_view or t in _COPIES


def _tangent_closure(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that depend on an output gradient (the backward's own work)."""
    todo = [n for n in graph.nodes if n.op == "placeholder" and str(n.target).startswith("tangents")]
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return seen


def _chain_from(start: fx.Node, backward: set[fx.Node]) -> set[fx.Node] | None:
    """The dequantize chain beginning at ``start`` (a uint8 -> float node), or None where
    recomputing it in backward would not pay (module doc)."""
    codes_bytes = _nbytes(start.args[0])
    chain: set[fx.Node] = set()
    todo = [start]
    while todo:
        n = todo.pop()
        if n in chain:
            continue
        chain.add(n)
        for user in n.users:
            if user.op == "output":
                return None  # a forward output (gradients depend on the output gradient)
            if user in backward or user in chain:
                continue  # a consumer that runs in backward anyway
            if not _elementwise(user):
                return None  # a forward use: keep the partitioner's choice
            todo.append(user)
    for n in chain:
        for other in n.all_input_nodes:
            if other in chain or other is start.args[0] or other.op == "placeholder":
                continue
            if _nbytes(other) * 4 > codes_bytes:
                return None
    return chain


def _made_only_for(chain: set[fx.Node], codes: fx.Node, backward: set[fx.Node]) -> set[fx.Node]:
    """The small floating pointwise ops and views that compute ``chain``'s other inputs and
    nothing else (module doc): recomputed with the chain, they cost no forward launch."""
    codes_bytes = _nbytes(codes)
    mine = set(chain)
    todo = [o for n in chain for o in n.all_input_nodes if o not in chain and o is not codes]
    while todo:
        n = todo.pop()
        v = _value(n)
        if n in mine or n in backward or v is None or not v.is_floating_point() or not _elementwise(n):
            continue
        # a forward output (the joint graph's output node also depends on the output gradients)
        # or a forward consumer outside the chain: the forward computes it anyway
        if _nbytes(n) * 4 > codes_bytes or any(u.op == "output" or (u not in mine and u not in backward)
                                               for u in n.users):
            continue
        mine.add(n)
        todo.extend(n.all_input_nodes)
    return mine - chain


def mark_dequantize_for_backward(graph: fx.Graph) -> int:
    """Tag the dequantize chains of ``graph`` (a joint forward + backward graph) as the module
    doc says; returns how many chains were tagged."""
    backward = _tangent_closure(graph)
    tagged = 0
    for node in list(graph.nodes):
        src = node.args[0] if node.op == "call_function" and node.args else None
        v, s = _value(node), _value(src)
        if v is None or s is None or s.dtype != torch.uint8 or not v.is_floating_point():
            continue
        if node in backward or not _elementwise(node):
            continue
        chain = _chain_from(node, backward)
        if chain is None:
            continue
        for n in chain | _made_only_for(chain, src, backward):
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        src.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        tagged += 1
    return tagged


class SaveCodes(CustomGraphPass):
    """:func:`mark_dequantize_for_backward` as an Inductor ``joint_custom_post_pass`` (its uuid
    the hash of this file, so Inductor's caches stay on)."""

    def __call__(self, graph: fx.Graph) -> None:
        mark_dequantize_for_backward(graph)

    def uuid(self):
        return get_hash_for_files((__file__,))
