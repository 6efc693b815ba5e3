"""Model rules: which module set (``msa``, ``ffn``, ``other``) each module belongs to, its
head count (the default number of groups), and which functional ops a generic fallback
cannot reach.

Module sets follow the paper's Table 8: **MSA** is everything in the attention branch of a
block (``norm1``, the qkv/q/kv linears, PVT's spatial-reduction conv + norm, the attention
core, ``proj``); **FFN** is the MLP branch (``norm2``, ``fc1``, activation, PVT's
depthwise conv, ``fc2``); **other** is everything outside blocks: patch embedding,
downsampling (Swin patch merging, PVT overlapping patch embeddings), stage/final norms and
the classifier head.

Blocks are found structurally: a module with an ``attn`` child and an ``mlp`` child (timm's
ViT/DeiT ``Block`` and ``ResPostBlock``, Swin's ``SwinTransformerBlock``, PVT-v2's
``Block``, and most other timm transformers). Inside a block, children named ``norm1`` or
containing ``attn`` are MSA, ``norm2`` or containing ``mlp``/``ffn`` are FFN, anything else
(layer scale, drop path) is ``other``. A module outside every block takes the head count of
the next block in module order (patch embedding, downsampling) or, after the last block,
of the previous one (final norms, head).

Models without such blocks fall back to names: the innermost module on a module's path whose
class name or attribute name contains ``attn`` / ``attention`` is MSA, ``mlp`` / ``ffn`` /
``feedforward`` (but not ``head``: lucidrains' classifier ``mlp_head``) is FFN, the rest is
``other`` (so ``nn.ModuleList([Attention(...), FeedForward(...)])`` blocks, whose names are
indices, are classified by their classes); head counts come from a ``num_heads`` (timm),
``heads`` (vit-pytorch, timm's Hiera), ``n_heads`` or ``n_head`` attribute on the way up, else
the layers' default (1 group).
"""
from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["ModuleInfo", "classify", "function_attributes", "scan_functional_ops", "scan_inline_scales",
           "FUNCTIONAL_OPS", "is_position_table_mlp", "linear_call_weights"]

MODULE_SETS = ("msa", "ffn", "other")


@dataclass(frozen=True)
class ModuleInfo:
    module_set: str  # msa | ffn | other
    heads: Optional[int]  # head count of the owning/nearest block (None: unknown)
    block: Optional[str]  # name of the owning block, if any


# where modules keep their head count: timm's num_heads; heads (lucidrains' vit-pytorch),
# n_heads / n_head (nanoGPT-style code)
_HEAD_ATTRS = ("num_heads", "heads", "n_heads", "n_head")


def _head_count(m: nn.Module) -> Optional[int]:
    for attr in _HEAD_ATTRS:
        h = getattr(m, attr, None)
        if isinstance(h, int) and not isinstance(h, bool) and h > 0:
            return h
    return None


def _heads_of(module: nn.Module) -> Optional[int]:
    attn = getattr(module, "attn", None)
    for m in (attn, module):
        h = _head_count(m) if m is not None else None
        if h is not None:
            return h
    return None


def _is_block(module: nn.Module) -> bool:
    return isinstance(getattr(module, "attn", None), nn.Module) and isinstance(getattr(module, "mlp", None), nn.Module)


def _child_set(child_name: str) -> str:
    n = child_name.lower()
    if n == "norm1" or "attn" in n or "attention" in n:
        return "msa"
    if n == "norm2" or "mlp" in n or "ffn" in n:
        return "ffn"
    return "other"


def _part_set(text: str) -> Optional[str]:
    """The set a module's name or class name says: msa, ffn, or None. ``head`` is a
    classifier (lucidrains' ``mlp_head``), not a block's MLP."""
    t = text.lower()
    if "attn" in t or "attention" in t:
        return "msa"
    if ("mlp" in t or "ffn" in t or "feedforward" in t) and "head" not in t:
        return "ffn"
    return None


def _name_set(model: nn.Module, path: str) -> str:
    """Outside timm-style blocks: the innermost module on ``path`` whose class name or name says
    attention or MLP (user code's ``Attention`` / ``FeedForward`` classes in a ModuleList, as
    lucidrains' vit-pytorch has them, where the names are list indices)."""
    parts = path.split(".")
    for k in range(len(parts), 0, -1):
        found = _part_set(type(model.get_submodule(".".join(parts[:k]))).__name__) or _part_set(parts[k - 1])
        if found:
            return found
    return "other"


def classify(model: nn.Module) -> Dict[str, ModuleInfo]:
    """``{module name: ModuleInfo}`` for every module of ``model`` (names as in
    ``model.named_modules()``)."""
    named = list(model.named_modules())
    blocks: List[Tuple[int, str, nn.Module]] = []
    for i, (name, m) in enumerate(named):
        if _is_block(m) and not any(name.startswith(b + ".") for _, b, _ in blocks):
            blocks.append((i, name, m))
    info: Dict[str, ModuleInfo] = {}
    if not blocks:
        for name, m in named:
            heads = None
            # nearest num_heads on the way up
            parts = name.split(".") if name else []
            for k in range(len(parts), -1, -1):
                owner = model.get_submodule(".".join(parts[:k])) if k else model
                heads = _head_count(owner)
                if heads is not None:
                    break
            info[name] = ModuleInfo(_name_set(model, name) if name else "other", heads, None)
        return info

    block_names = [b for _, b, _ in blocks]
    block_heads = {b: _heads_of(m) for _, b, m in blocks}
    block_pos = [i for i, _, _ in blocks]
    for i, (name, m) in enumerate(named):
        owner = next((b for b in block_names if name == b or name.startswith(b + ".")), None)
        if owner is not None:
            if name == owner:
                info[name] = ModuleInfo("other", block_heads[owner], owner)
                continue
            child = name[len(owner) + 1:].split(".")[0]
            info[name] = ModuleInfo(_child_set(child), block_heads[owner], owner)
            continue
        # outside blocks: the next block's heads, else the previous block's
        nxt = next((b for p, b in zip(block_pos, block_names) if p > i), None)
        ref = nxt if nxt is not None else block_names[-1]
        info[name] = ModuleInfo("other", block_heads[ref], None)
    return info


# ----------------------------------------------------------------------------- functional ops
# call name -> op, for calls like F.softmax(...), x.softmax(...), torch.matmul(...)
FUNCTIONAL_OPS = {
    "scaled_dot_product_attention": "sdpa",
    "multi_head_attention_forward": "sdpa",
    "matmul": "matmul",
    "bmm": "matmul",
    "baddbmm": "matmul",
    "einsum": "matmul",
    "softmax": "softmax",
    "log_softmax": "softmax",
    "gelu": "gelu",
    "layer_norm": "layernorm",
    "fast_layer_norm": "layernorm",
    "linear": "linear",
    "conv1d": "conv",
    "conv2d": "conv",
    "conv3d": "conv",
    "conv_transpose1d": "conv",
    "conv_transpose2d": "conv",
    "conv_transpose3d": "conv",
    "batch_norm": "batchnorm",
    "group_norm": "groupnorm",
    "rms_norm": "rmsnorm",
    "rms_norm2d": "rmsnorm",  # (timm's NCHW forms, called inline by a module of its own)
    "fast_rms_norm2d": "rmsnorm",
    "relu": "relu",
    "relu_": "relu",
    "relu6": "relu",
    "leaky_relu": "relu",  # (routed through a Mesa LeakyReLU child: patch/functional_calls.py)
    "leaky_relu_": "relu",
    "hardtanh": "relu",
    "hardswish": "hardswish",
    "hardsigmoid": "hardswish",
    "normalize": "normalize",
    "amax": "maxpool",
    "max_pool2d": "maxpool",
    "avg_pool2d": "avgpool",
    "silu": "silu",
}


def function_attributes(m: nn.Module) -> Dict[str, str]:
    """``{attribute: op}`` for the torch functions ``m`` holds as instance attributes (torch's
    ``nn.TransformerEncoderLayer(activation="gelu")`` keeps ``self.activation = F.gelu`` and
    calls ``self.activation(x)``): a call the source scan reads as a method call, so the op
    would be neither compressed nor reported."""
    return {name: FUNCTIONAL_OPS[fn.__name__] for name, fn in vars(m).items()
            if callable(fn) and not isinstance(fn, (nn.Module, type))
            and (getattr(fn, "__module__", None) or "").startswith("torch")
            and getattr(fn, "__name__", None) in FUNCTIONAL_OPS}


def plain_attribute_calls(cls: type, attr: str) -> bool:
    """Whether ``cls``'s forward (and the methods it reaches) uses ``self.<attr>`` at least once
    and only ever as ``self.<attr>(x)``: one positional argument, no keywords (so a module
    computing ``attr(x)`` can stand in for it). Static."""
    uses = plain = 0
    for _, tree in _methods_reached(cls):
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and node.attr == attr):
                uses += 1
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                    and node.func.attr == attr and len(node.args) == 1 and not node.keywords
                    and not isinstance(node.args[0], ast.Starred)):
                plain += 1
    return plain > 0 and uses == plain


def _methods_reached(cls: type, functions: bool = False) -> List[Tuple[str, object]]:
    """``forward`` and the methods of ``cls`` it calls as ``self.name(...)``, transitively; with
    ``functions``, also the functions of ``cls``'s own module they call by name (torchvision's
    ``ShiftedWindowAttention.forward`` is one call to ``shifted_window_attention(x,
    self.qkv.weight, ...)``, where its linear, matmul and softmax are). Only the attention
    scan follows functions: a whole model's forward reaches helpers (timm's
    ``global_pool_nlc``) whose ops are no attention core."""
    module_globals = getattr(sys.modules.get(cls.__module__), "__dict__", {})
    todo, seen, out = [("self", "forward")], set(), []
    while todo:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        fn = getattr(cls, key[1], None) if key[0] == "self" else module_globals.get(key[1])
        if fn is None or not callable(fn) or isinstance(fn, type):
            continue
        if key[0] == "module" and not (isinstance(fn, types.FunctionType) and fn.__module__ == cls.__module__):
            continue  # (only plain functions written beside the class)
        fn = inspect.unwrap(fn)
        # (a __module__ of None: an fx GraphModule's generated forward, timm's feature_cls="fx")
        if (getattr(fn, "__module__", None) or "").startswith("torch.nn.modules.module"):
            continue
        try:
            src = textwrap.dedent(inspect.getsource(fn))
            tree = ast.parse(src)
        except (OSError, TypeError, SyntaxError, IndentationError):
            continue
        out.append((key[1], tree))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                todo.append(("self", f.attr))
            elif functions and isinstance(f, ast.Name) and f.id in module_globals:
                todo.append(("module", f.id))
    return out


_SCAN_CACHE: Dict[object, object] = {}


def _functional_names(cls: type, functions: bool):
    """``"@"`` for each ``a @ b`` and the called name of each call (``F.softmax`` -> ``softmax``)
    in ``cls.forward`` and what it reaches, but calls of ``self.<name>`` (child modules, handled
    by the leaf conversion)."""
    for _, tree in _methods_reached(cls, functions):
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                yield "@"
            elif isinstance(node, ast.Call) and not _self_attribute(node.func):
                yield _called_name(node)


def _called_name(call: ast.Call) -> Optional[str]:
    """The name a call calls: ``F.softmax(...)``, ``x.softmax(...)`` and ``softmax(...)`` ->
    ``softmax``; None for anything else (a call of a call's result, a subscript)."""
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def methods_reached_code(cls: type, functions: bool = False) -> frozenset:
    """The code objects of ``cls.forward`` and the methods it reaches on ``self`` (what
    :func:`scan_functional_ops` reads; with ``functions``, the functions of its module too),
    with the code nested in them (comprehensions, lambdas, inner functions): where a call the
    scan counted runs. Cached per class."""
    key = ("code", cls, functions)
    if key not in _SCAN_CACHE:
        codes, todo = set(), []
        module_globals = getattr(sys.modules.get(cls.__module__), "__dict__", {})
        for name, _ in _methods_reached(cls, functions):
            fn = getattr(cls, name, None) or (module_globals.get(name) if functions else None)
            fn = inspect.unwrap(fn or (lambda: None))
            if isinstance(getattr(fn, "__code__", None), types.CodeType):
                todo.append(fn.__code__)
        while todo:
            code = todo.pop()
            if code not in codes:
                codes.add(code)
                todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        _SCAN_CACHE[key] = frozenset(codes)
    return _SCAN_CACHE[key]


def scan_functional_ops(cls: type, functions: bool = False) -> Tuple[str, ...]:
    """Ops (``matmul``, ``softmax``, ``sdpa``, ...) that ``cls.forward`` (and the methods it
    calls on ``self``; with ``functions``, the functions of its module it calls) computes
    functionally, i.e. not through a child module. Static: the source is parsed, nothing runs."""
    key = (cls, functions)
    if key not in _SCAN_CACHE:
        found = {"matmul" if name == "@" else FUNCTIONAL_OPS.get(name) for name in _functional_names(cls, functions)}
        _SCAN_CACHE[key] = tuple(sorted(found - {None}))
    return _SCAN_CACHE[key]


def matmul_kinds(cls: type, functions: bool = False) -> Tuple[str, ...]:
    """How ``cls.forward`` multiplies batched tensors: ``@`` and the calls ``matmul``, ``bmm``,
    ``baddbmm``, ``einsum`` it makes (a ``self.<name>`` child excluded). Static, as
    :func:`scan_functional_ops`."""
    key = ("kinds", cls, functions)
    if key not in _SCAN_CACHE:
        kinds = {"@", "matmul", "bmm", "baddbmm", "einsum"}
        _SCAN_CACHE[key] = tuple(sorted(set(_functional_names(cls, functions)) & kinds))
    return _SCAN_CACHE[key]


_PRODUCT_CALLS = ("matmul", "bmm", "einsum")


def product_order(cls: type) -> Optional[Tuple[str, ...]]:
    """The batched products of ``cls.forward`` in the order they complete (``"@"``,
    ``"matmul"``, ``"bmm"``, ``"einsum"``; ``self.<name>`` children excluded), or None when the
    methods it calls make products too (no order from the source then). By each node's end in
    the source: an inner product completes before the one around it. Static, cached."""
    key = ("order", cls)
    if key not in _SCAN_CACHE:
        tree = _forward_holding_products(cls)
        _SCAN_CACHE[key] = None if tree is None else tuple(kind for _, kind in sorted(_products(tree, cls)))
    return _SCAN_CACHE[key]


def _forward_holding_products(cls: type):
    """The syntax tree of ``cls.forward`` when no method or module-level function it calls makes
    a batched product of its own (the products' order and place are then the forward's), else None."""
    trees = _methods_reached(cls, functions=True)
    if not trees or trees[0][0] != "forward" or any(_products(tree, cls) for _, tree in trees[1:]):
        return None
    return trees[0][1]


def _products(tree, cls: type) -> List[Tuple[Tuple[int, int], str]]:
    """The batched products in ``tree`` with where each ends. An ``einsum`` counts only where it
    is torch's (``torch.einsum``, or a name bound to it in ``cls``'s module): ``einops.einsum``
    calls torch's from einops' own code, which the capture does not route."""
    module_globals = getattr(sys.modules.get(cls.__module__), "__dict__", {})
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            out.append(((node.end_lineno, node.end_col_offset), "@"))
        elif isinstance(node, ast.Call) and not _self_attribute(node.func):
            name = _called_name(node)
            if name == "einsum" and not _is_torch_einsum(node.func, module_globals):
                continue
            if name in _PRODUCT_CALLS:
                out.append(((node.end_lineno, node.end_col_offset), name))
    return out


def _is_torch_einsum(f, module_globals: dict) -> bool:
    if isinstance(f, ast.Name):
        return module_globals.get(f.id) is torch.einsum
    return isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and module_globals.get(f.value.id) is torch


def scalar_product_scales(cls: type) -> frozenset:
    """Attributes ``p`` that ``cls.forward`` multiplies a batched product by, as ``product *
    self.p`` or ``product * self.p.exp()`` (either side): LSA's learned temperature. Static."""
    key = ("scalar_scales", cls)
    if key not in _SCAN_CACHE:
        found = set()
        for _, tree in _methods_reached(cls):
            for node in ast.walk(tree):
                if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
                    continue
                for side, other in ((node.left, node.right), (node.right, node.left)):
                    name = _self_attribute(side.func.value if _is_exp_call(side) else side)
                    if name is not None and _is_product(other, cls):
                        found.add(name)
        _SCAN_CACHE[key] = frozenset(found)
    return _SCAN_CACHE[key]


def _is_product(node, cls: type) -> bool:
    """``node`` is a batched product, or a product times or over other factors (``q @ k^T *
    self.scale``); not a call around one (``self.to_out(attn @ v)``)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
        return _is_product(node.left, cls) or _is_product(node.right, cls)
    if isinstance(node, (ast.BinOp, ast.Call)):
        found = _products(node, cls)
        return bool(found) and max(found)[0] == (node.end_lineno, node.end_col_offset)
    return False


def _is_exp_call(node) -> bool:
    return (isinstance(node, ast.Call) and not node.args and isinstance(node.func, ast.Attribute)
            and node.func.attr == "exp")


def linear_call_weights(cls: type) -> Optional[Tuple[str, ...]]:
    """The children whose weight each ``F.linear(x, self.<child>.weight, ...)`` call of
    ``cls.forward`` (and the methods it reaches) passes, or None where a call passes another
    weight (a LoRA adapter's ``F.linear(x, self.lora_A)``, a weight built at call time): only a
    child's weight is routed through its Mesa ``Linear`` (``generic_attention._route_linear``)."""
    key = ("linear_weights", cls)
    if key not in _SCAN_CACHE:
        children = []
        for _, tree in _methods_reached(cls):
            # names bound to a child's weight (w = self.fc.weight; F.linear(x, w)); a name bound
            # to anything else as well is no child's
            local: dict = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    name, bound = node.targets[0].id, _child_weight(node.value)
                    local[name] = bound if local.get(name, bound) == bound else None
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and not _self_attribute(node.func)
                        and _called_name(node) == "linear"):
                    continue
                weight = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "weight"), None)
                child = local.get(weight.id) if isinstance(weight, ast.Name) else _child_weight(weight)
                if child is None:
                    children = None
                    break
                children.append(child)
            if children is None:
                break
        _SCAN_CACHE[key] = None if children is None else tuple(children)
    return _SCAN_CACHE[key]


def _child_weight(node) -> Optional[str]:
    """``child`` for ``self.<child>.weight``, else None."""
    return _self_attribute(node.value) if isinstance(node, ast.Attribute) and node.attr == "weight" else None


def _self_attribute(node) -> Optional[str]:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def core_in_loop(cls: type) -> bool:
    """Whether ``cls.forward`` runs its attention core once per head in a loop (timm's
    EfficientViT-M ``CascadedGroupAttention``: ``for head_idx, ...: attn = q^T @ k ...;
    attn.softmax(-1); v @ attn^T``): one ``for``/``while`` in ``forward`` itself holds its two
    batched products and a softmax, and no product is outside it. Static, cached."""
    key = ("loop", cls)
    if key not in _SCAN_CACHE:
        tree = _forward_holding_products(cls)
        found = False
        if tree is not None and len(_products(tree, cls)) == 2:
            for node in ast.walk(tree):
                if isinstance(node, (ast.For, ast.While)):
                    inner = ast.Module(body=node.body, type_ignores=[])
                    softmax = any(isinstance(n, ast.Call) and _called_name(n) == "softmax" for n in ast.walk(inner))
                    if softmax and len(_products(inner, cls)) == 2:
                        found = True
                        break
        _SCAN_CACHE[key] = found
    return _SCAN_CACHE[key]


def count_functional_calls(cls: type, call_name: str, functions: bool = False) -> int:
    """How many ``F.<call_name>(...)`` / ``x.<call_name>(...)`` calls the source of ``cls.forward``
    (and the methods it calls on ``self``) holds; ``self.<call_name>(...)`` (a child module) is
    not counted. Static, as :func:`scan_functional_ops`."""
    key = ("count", cls, call_name, functions)
    if key not in _SCAN_CACHE:
        _SCAN_CACHE[key] = sum(1 for name in _functional_names(cls, functions) if name == call_name)
    return _SCAN_CACHE[key]


def scan_inline_scales(cls: type) -> Tuple[str, ...]:
    """Attributes ``cls.forward`` multiplies inline, ``self.gamma_1 * y`` or ``y * self.ls1``
    (candidates for a layer-scale parameter; the caller keeps the 1-D parameters). Static."""
    if ("scales", cls) in _SCAN_CACHE:
        return _SCAN_CACHE[("scales", cls)]
    found = set()
    for _, tree in _methods_reached(cls):
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                for side in (node.left, node.right):
                    if (isinstance(side, ast.Attribute) and isinstance(side.value, ast.Name)
                            and side.value.id == "self"):
                        found.add(side.attr)
    res = tuple(sorted(found))
    _SCAN_CACHE[("scales", cls)] = res
    return res


# ----------------------------------------------------------------------------- left stock
# MLPs that turn a relative-position *table* into an attention bias (timm's ``RelPosMlp``,
# SwinV2's ``cpb_mlp``): their activations have the size of the table, not of the batch, so
# compressing them saves next to nothing and only adds rounding noise to sums over a few
# (2w-1)^2 rows. They are left stock.
_POSITION_TABLE_CLASSES = ("RelPosMlp",)
_POSITION_TABLE_CHILDREN = ("cpb_mlp", "meta_mlp")  # SwinV2, SwinV2-CR


def is_position_table_mlp(name: str, module: nn.Module) -> bool:
    return type(module).__name__ in _POSITION_TABLE_CLASSES or name.rsplit(".", 1)[-1] in _POSITION_TABLE_CHILDREN
