"""``describe(model)``: a plain-text table of what is compressed where, for logs."""
from __future__ import annotations

from typing import List, Optional, Tuple

from torch import nn

from mesa_train.nn import Einsum, MatMul, input_copy

from .attention import STOCK_ATTENTION_CLASSES
from .block import norm_fed_ids
from mesa_train.models import unwrap_module

from .core import OPS, PATCH_INFO_ATTR, mesa_layer_op
from .coverage import coverage, format_coverage
from .duplicates import full_operand_duplicates, fused_back_attentions, left_stock_duplicates
from .skip_marks import FULL_OPERANDS_ATTR, FUSED_BACK_ATTR, LEFT_STOCK_ATTR
from .start_up import skip_failure
from .mlp import STOCK_SHARED_MLP_CLASSES
from .rules import classify
from .scale_branch import waiting_halves
from .table import format_table

__all__ = ["describe", "describe_rows"]


def _matmul_operands(layer, producer: Optional[str]) -> Tuple[List[str], List[str]]:
    """Per-operand text for a Mesa ``MatMul`` and the quantizer names to count as to
    initialisation (those of operands the layer quantizes itself, not shared ones).

    What an operand is kept as comes from the layer's last compressed call
    (``MatMul.last_saved``); before any call, ``producer`` (the Mesa Softmax whose output
    the ``a`` operand is, for ``attn @ v``) says that ``a`` will be shared."""
    last = getattr(layer, "last_saved", None)
    parts, counted = [], []
    for i, o in enumerate(("a", "b")):
        mine = o in layer.operands
        kind = last[i] if last else None
        if kind is None:
            kind = "shared" if (o == "a" and producer) else ("int8" if mine else "full")
        if kind == "shared":
            parts.append(f"{o}: int8 shared with {producer or 'its producer'}")
        elif kind == "int8":
            parts.append(f"{o}: int8")
            counted.append(f"quantizer_{o}")
        elif o in layer.__dict__.get(FULL_OPERANDS_ATTR, ()):
            parts.append(f"{o}: full precision, as another module keeps it (skip_duplicated)")
        else:
            parts.append(f"{o}: full precision (stock)")
    return parts, counted


def _state(layer, producer: Optional[str] = None, shared_from: Optional[str] = None) -> str:
    if layer is None or not hasattr(layer, "quant_options"):
        return ""
    o = layer.quant_options
    if not o.enabled:
        if layer.__dict__.get(LEFT_STOCK_ATTR):  # patch/duplicates.py
            return "stock: other modules keep its input in full (skip_duplicated)"
        return "disabled (stock)"
    parts = [o.estimator + (f" decay={o.decay:g}" if o.estimator == "running" else ""), o.rounding]
    if o.symmetric:
        parts.append("symmetric")
    if not o.is_default_format:
        parts.append(f"{o.bits}-bit" + (" pow2" if o.scale == "pow2" else "")
                     + (" patch4x4" if o.layout == "patch4x4" else ""))
    qs = layer.quantizers()
    if isinstance(layer, MatMul):
        operand_parts, counted = _matmul_operands(layer, producer)
        parts.extend(operand_parts)
        qs = [getattr(layer, n) for n in counted]
    if shared_from:  # its own quantizer runs only where the MLP / block falls back
        parts.append(shared_from)
        qs = [q for q in qs if q.initialized]
    borrowed = [q for q in qs if not q.initialized and q.__dict__.get(input_copy.READ_ANOTHERS)]
    if borrowed:  # it saved the codes a parallel layer made of the same input (nn/input_copy.py)
        parts.append("input from a parallel layer's copy")
        qs = [q for q in qs if q not in borrowed]
    if qs:
        n_init = sum(bool(q.initialized) for q in qs)
        parts.append("initialized" if n_init == len(qs) else f"uninitialized ({len(qs) - n_init}/{len(qs)})")
    if not layer.training:
        parts.append("eval: stock")
    return ", ".join(parts)


def _groups(layer) -> str:
    qs = layer.quantizers() if hasattr(layer, "quantizers") else []
    if not qs:
        op = mesa_layer_op(layer)
        if op == "relu":
            return "-"
        return str(layer.quant_options.num_groups) if op == "matmul" else ""  # share-only MatMul
    gs = sorted({q.options.num_groups for q in qs})
    return "/".join(str(g) for g in gs)


def _op_label(layer, op: str) -> str:
    if isinstance(layer, Einsum):  # op matmul, its own kind of layer (MViTv2's and SAM's rel-pos einsums)
        return "matmul[einsum]"
    if isinstance(layer, MatMul) and tuple(layer.operands) != ("a", "b"):
        return f"matmul[{','.join(layer.operands) or 'share-only'}]"
    return op


def describe_rows(model: nn.Module) -> List[List[str]]:
    """``[[layer, op, module set, groups, state], ...]`` for every Mesa layer and patched
    attention module. A ``MatMul`` that does not compress both operands itself is labelled
    ``matmul[a]``, ``matmul[b]`` or ``matmul[share-only]`` (``operands=()``: the
    ``attn @ v`` of a softmax-only patch); its state says per operand what is kept."""
    root = unwrap_module(model, "describe_rows")
    info = classify(root)
    norm_fed = norm_fed_ids(root)
    rows = []
    for name, m in root.named_modules():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        mi = info.get(name) or info.get(owner)
        mset = mi.module_set if mi else "other"
        if type(m) in STOCK_ATTENTION_CLASSES:
            path = getattr(m, "mesa_attn_path", "stock")
            core = ",".join(getattr(m, "mesa_core_ops", ())) or "-"
            detail = {"explicit": "softmax(q@k^T)@v via qk_matmul/softmax/av_matmul",
                      "fused": "F.scaled_dot_product_attention via sdpa (int8 q,k,v)",
                      "stock": "stock forward"}[path]
            if path == "stock" and FUSED_BACK_ATTR in m.__dict__:  # patch/duplicates.py
                detail = "stock forward, fused as built: the explicit path kept an N x N map (skip_duplicated)"
            rows.append([name, f"attention[{path}]", mset, str(getattr(m, "num_heads", "")),
                         f"core ops: {core}; {detail}"])
            continue
        op = mesa_layer_op(m)
        if op is None:
            continue
        producer = None
        parent = root.get_submodule(owner) if "." in name else None
        if op == "matmul" and name.endswith(".av_matmul"):
            # (before a call: with attention dropout on, attn @ v takes the dropped map, which
            # it keeps itself; what the last call kept says so after one)
            drop = getattr(parent, "attn_drop", None)
            if mesa_layer_op(getattr(parent, "softmax", None)) == "softmax" and not (
                    isinstance(drop, nn.Dropout) and drop.p > 0):
                producer = "softmax"
        # fc2 of a shared-copy MLP: its weight gradient comes from the act's copy of h
        shared = (op == "linear" and name.endswith(".fc2") and type(parent) in STOCK_SHARED_MLP_CLASSES
                  and getattr(parent, "mesa_shared", False))
        label, shared_from = _op_label(m, op), None
        if shared:
            label, shared_from = "linear[mlp-shared]", "input from the act's copy (mlp=shared)"
        elif op == "linear" and id(m) in norm_fed:  # qkv / fc1 after a block's norm (patch/block.py)
            label, shared_from = "linear[norm-shared]", "input from the norm's copy (norm_linear=shared)"
        rows.append([name, label, mset, _groups(m), _state(m, producer, shared_from)])
    return rows


def describe(model: nn.Module, example_input=None, *, run=None) -> str:
    """A readable table: layer, op, module set, groups, state, then a summary and any
    functional ops the patcher could not reach. With ``example_input``, also the measured
    coverage (:func:`mesa_train.patch.coverage.coverage`: one training forward, saved bytes
    per op type, compressed vs left as is, total ratio to stock; the model is left as it
    was)."""
    text = _describe_layers(unwrap_module(model, "describe"))
    if example_input is None:
        return text
    return text + "\n" + format_coverage(coverage(model, example_input, run=run))


def _describe_layers(root: nn.Module) -> str:
    rows = describe_rows(root)
    record = getattr(root, PATCH_INFO_ATTR, None) or {}
    title = f"Mesa patch of {type(root).__name__}"
    if record:
        title += f": ops={','.join(record.get('ops', ()))} modules={','.join(record.get('modules', ()))}"
        requests = record.get("requests", ())
        if len(requests) > 1 and any(opts for _, opts in requests):  # (each call's options for its ops)
            title += "; options by call: " + "; ".join(
                f"{'all' if set(ops) == set(OPS) else ','.join(ops)} {opts or '{}'}" for ops, opts in requests)
        elif record.get("options"):
            title += f" options={record['options']}"
    else:
        title += " (not patched by patch_model)"
    lines = [title, format_table(["layer", "op", "set", "groups", "state"], rows)]
    counts = {}
    for r in rows:
        key = r[1] if r[1].startswith("matmul[") else r[1].split("[")[0]  # matmul[share-only] apart
        counts[key] = counts.get(key, 0) + 1
    lines.append("total: " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "nothing patched"))
    unreached = record.get("unreached", {})
    if unreached:
        lines.append("functional ops NOT reached (stay uncompressed):")
        for n, ops in unreached.items():
            mod = root if n == "<root>" else root.get_submodule(n)
            lines.append(f"  {n} ({type(mod).__name__}): {', '.join(ops)}")
    kept = record.get("stock_batchnorm", ())
    if kept:  # patch/cancellation.py: their gradients would be cancellations that 8 bits swamp
        lines.append(f"BatchNorms kept stock (scale-invariance cancellations; cancelling_bn='compress' "
                     f"compresses them): {len(kept)}: {', '.join(kept)}")
    waiting = waiting_halves(root, kept)
    if waiting:  # patch/scale_branch.py: a 1x1 depthwise conv into a BatchNorm is converted as a pair
        lines.append(f"scale-branch layers kept stock until a call asks for their pair's other op (conv / batchnorm): "
                     f"{len(waiting)}: {', '.join(waiting)}")
    skipped = left_stock_duplicates(root)
    if skipped:  # patch/duplicates.py: their copies would only add bytes
        lines.append(f"layers left stock, as other modules keep their inputs in full (skip_duplicated): "
                     f"{len(skipped)}: {', '.join(skipped)}")
    full = full_operand_duplicates(root)
    if full:  # patch/duplicates.py: those operands' copies would only add bytes
        lines.append(f"MatMul operands kept in full, as other modules keep them anyway "
                     f"(skip_duplicated): {len(full)}: " + ", ".join(f"{n} ({', '.join(o)})" for n, o in full.items()))
    fused_back = fused_back_attentions(root)
    if fused_back:  # patch/duplicates.py: their explicit path kept more than the fused one
        lines.append(f"attentions back on the fused path they were built with (skip_duplicated): {len(fused_back)}: "
                     f"{', '.join(fused_back)}")
    if skip_failure(root):  # patch/start_up.py: training's (or a bench row's) start-up measurement
        lines.append(f"skip_duplicated at start-up {skip_failure(root)}")
    # a model patched from a plan (patch_model(plan=), mesa.plan=): which layer compresses what
    from mesa_train.plan.apply import describe_plan  # here: mesa_train.plan imports this package

    plan_text = describe_plan(root)
    if plan_text:
        lines.append(plan_text)
    return "\n".join(lines)
