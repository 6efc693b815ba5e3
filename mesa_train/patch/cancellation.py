"""Which BatchNorms have gradients that are cancellations (kept stock by ``patch_model``).

A train-mode BatchNorm makes its output invariant to a positive rescaling of its input (but
for ``eps``). When the output of BatchNorm ``A`` reaches another normalisation ``B`` through
per-channel, positively homogeneous ops only (ReLU, LeakyReLU, a depthwise conv, identity, pooling,
channel split / concat, a scalar affine, a residual add none of whose summands comes from elsewhere
than ``A``) on every path, rescaling ``A``'s ``weight`` and ``bias`` of one
channel together leaves ``B``'s output unchanged, so ``A``'s exact ``weight`` gradient is
``-bias * dbias / weight`` plus an ``eps`` term: zero at initialisation (bias 0), a tiny
difference of large sums later. 8-bit noise of ``A``'s ``x_hat`` (its weight gradient is
``sum(g * x_hat)``) and of ``B``'s (the gradient reaching ``A``) swamps it: EfficientViT-M,
GhostNet, InceptionNeXt, TinyViT, HGNetV2 (DESIGN.md, "Scale-invariance cancellations");
a 16-bit ``x_hat`` is not enough (EfficientViT-M 0.58, GhostNet 0.20).

:func:`cancellation_batchnorms` finds both ends of every such path on a ``torch.fx`` trace
of the model (``_tracers``: through timm's no-trace modules with data-dependent branches taken
as False, else with those modules as leaves); a model that does not trace gets none (every
BatchNorm compressed, as before). Tracing runs the forward on proxies only: no tensor is
computed and no module state is meant to change (a forward that caches a traced value on
the module would keep a proxy; the 90 zoo models pass their forward / eval / state_dict
checks after patching).
"""
from __future__ import annotations

import heapq
import operator
import warnings
from typing import Dict, Optional, Set

import torch
from torch import nn
import torch.nn.functional as F

__all__ = ["CANCELLING_BN", "cancellation_batchnorms"]

# patch_model(cancelling_bn=...): leave the cancellation BatchNorms stock, or compress them anyway
CANCELLING_BN = ("stock", "compress")

_NORMS = (nn.BatchNorm2d, nn.BatchNorm1d, nn.LayerNorm, nn.GroupNorm)
_BATCH_NORMS = (nn.BatchNorm2d, nn.BatchNorm1d)  # the path ends kept stock with the start
# ReLU6 is homogeneous only below its cap, where nearly every value is: MobileNetV2's
# BatchNorm -> ReLU6 -> depthwise conv -> BatchNorm gave weight cosines -0.1 compressed
# (LeakyReLU, any slope, is positively homogeneous as ReLU is: f(a x) = a f(x) for a > 0)
_HOMOGENEOUS_ACTS = (nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU)
_PASS_MODULES = _HOMOGENEOUS_ACTS + (nn.Dropout, nn.Dropout2d, nn.MaxPool2d, nn.AvgPool2d, nn.ZeroPad2d,
                                     nn.MaxPool1d, nn.AvgPool1d)
_PASS_FUNCTIONS = {F.relu, torch.relu, F.relu6, F.leaky_relu, F.dropout, operator.getitem, torch.cat, torch.split,
                   torch.chunk, torch.flatten, torch.transpose, torch.permute, torch.reshape, F.pad, F.max_pool2d,
                   F.avg_pool2d, operator.add, operator.iadd}
# An add passes a path from A on only where each operand is a tensor computed from A: reached along
# the path (x + dwconv(relu(x)): rescaled with it, an exact invariance) or through a normalisation the
# path ends at (a residual branch x + f(norm(x)), small at init: layer scale, small weights, so a near
# cancellation; TinyViT, InceptionNeXt). A sibling branch or a constant stops it: MobileOne's
# identity-BN + conv-BN + scale-BN sums, whose summands are alike in size, kept all 222 BatchNorms stock
_ADDS = {operator.add, operator.iadd}
_MERGES = _ADDS | {torch.cat}
_PASS_METHODS = {"relu", "relu_", "contiguous", "flatten", "transpose", "permute", "reshape", "view", "split",
                 "chunk", "unflatten"}


def _tracers():
    """Two ``torch.fx`` tracers, finest first: (1) every module with children traced through,
    timm's no-trace modules included, a data-dependent branch taken as False (enough for a
    dataflow question: TinyViT's blocks branch on their window padding); (2) timm's no-trace
    modules and functions as leaves (what timm's FX feature extraction does)."""
    import torch.fx as fx
    try:
        from timm.layers._fx import get_notrace_functions, get_notrace_modules
        leaf, fns = tuple(get_notrace_modules()), tuple(f for f in get_notrace_functions() if callable(f))
    except ImportError:  # another timm layout: plain tracing
        leaf, fns = (), ()

    class _Fine(fx.Tracer):
        def __init__(self):
            super().__init__(autowrap_functions=fns)

        def is_leaf_module(self, m, qualname):
            # a normalisation is one node even with children (timm's BatchNormAct2d: drop, act)
            return isinstance(m, _NORMS) or len(m._modules) == 0 or super().is_leaf_module(m, qualname)

        def to_bool(self, obj):
            return False

    class _Coarse(_Fine):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, leaf) or super().is_leaf_module(m, qualname)

        def to_bool(self, obj):
            return fx.Tracer.to_bool(self, obj)

    return _Fine(), _Coarse()


def _affine_block(m: nn.Module) -> bool:
    """timm HGNetV2's ``LearnableAffineBlock`` (``scale * x + bias``, scalar parameters)."""
    try:
        from timm.models.hgnet import LearnableAffineBlock
    except ImportError:
        return False
    return isinstance(m, LearnableAffineBlock)


def _homogeneous_bn(m: nn.Module) -> bool:
    """A BatchNorm2d whose output is its affine output, or that followed by a ReLU (timm's
    ``BatchNormAct2d`` with ``act`` ReLU / identity and no dropout): where a path can start."""
    return isinstance(m, nn.BatchNorm2d) and _homogeneous_children(m)


def _homogeneous_children(m: nn.Module) -> bool:
    """A norm-act module's own ``act`` is ReLU, ReLU6, LeakyReLU or identity and its ``drop``
    identity (timm's ``BatchNormAct2d``, ``GroupNormAct``); true for a plain norm. Subclasses
    count: a model patched for ``relu`` first holds Mesa ReLUs (a review found its cancelling
    BatchNorm compressed then, weight gradient at cosine 0.34)."""
    act, drop = getattr(m, "act", None), getattr(m, "drop", None)
    return (act is None or isinstance(act, _HOMOGENEOUS_ACTS)) and (drop is None or isinstance(drop, nn.Identity))


def _affine_group_norm(m: nn.Module) -> bool:
    """A GroupNorm with its per-channel ``weight`` and ``bias`` (timm's ``GroupNorm1`` before
    LowFormer's and CPUBone's conv attention): its output is a per-channel affine map too, so a
    path can start there (kept stock with its ends, as a BatchNorm start is); a ``GroupNormAct``
    only with a ReLU or no activation."""
    return isinstance(m, nn.GroupNorm) and m.affine and _homogeneous_children(m)


def _per_channel(m: nn.Module) -> bool:
    if isinstance(m, _PASS_MODULES) or _affine_block(m):
        return True
    return isinstance(m, nn.Conv2d) and m.groups == m.in_channels == m.out_channels


def _data_users(node):
    """Users of ``node`` that take its values (not ``x.shape`` / ``x.size()`` / ``x.dim()``)."""
    return [u for u in node.users
            if not (u.op == "call_function" and u.target is getattr)
            and not (u.op == "call_method" and u.target in ("size", "dim"))]


def _literal_zero(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and a == 0


def cancellation_batchnorms(model: nn.Module) -> Set[str]:
    """Qualified names (in ``model``) of the BatchNorm2d, BatchNorm1d and GroupNorm modules to keep stock:

    * a BatchNorm all of whose output paths end at normalisations through per-channel,
      positively homogeneous ops (a residual add only where all its summands are computed from
      that BatchNorm: along those ops, or through a normalisation a path ends at), with the
      BatchNorms those paths end at;
    * an affine GroupNorm whose every path ends at normalisations that way, with those
      BatchNorms (LowFormer, CPUBone: ``GroupNorm1 -> depthwise conv -> BatchNorm``);
    * a BatchNorm one of whose branches reaches a BatchNorm1d through single-input
      per-channel ops (NextViT: ``norm1 -> AvgPool1d -> BatchNorm1d`` beside its query
      Linear), with those BatchNorm1d: that branch's gradient is exactly orthogonal to each
      of its output channels, a large cancelling term in the weight gradient that an 8-bit
      ``x_hat`` at either end breaks;
    * the BatchNorms every path from a scalar ``LearnableAffineBlock`` ends at (a scalar
      scale keeps the invariance through channel-mixing convs too)."""
    graph = _trace(model)
    if graph is None:
        return set()
    paths = _NormPaths(dict(model.named_modules()), graph)
    found: Set[str] = set()
    for start in graph.nodes:
        m = paths.module(start)
        if m is None or not start.users:
            continue
        scalar, bn, gn = _affine_block(m), _homogeneous_bn(m), _affine_group_norm(m)
        if not (scalar or bn or gn):
            continue
        ends = paths.ends_of_users(start, mixing=scalar)
        if ends:
            if bn or gn:
                found.add(start.target)
            found.update(n.target for n in ends if isinstance(paths.module(n), _BATCH_NORMS))
        elif bn:
            reached = paths.batchnorm1d_reached(start)
            if reached:
                found.add(start.target)
                found.update(n.target for n in reached)
    return found


def _trace(model: nn.Module):
    """The model's FX graph by the first tracer that manages it (finer first); None if none does."""
    for tracer in _tracers():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return tracer.trace(model)
        except Exception:  # noqa: BLE001 - try the coarser one; untraceable model: nothing found
            continue
    return None


class _NormPaths:
    """Where the paths out of a graph node end: the normalisations reached through ops that
    keep the invariance (per-channel, positively homogeneous; channel-mixing ones too when
    ``mixing``, i.e. from a scalar scale). Judged per start: whether an add passes depends on
    where its other summands come from."""

    def __init__(self, mods: Dict[str, nn.Module], graph):
        self.mods = mods
        self.order = {n: i for i, n in enumerate(graph.nodes)}  # a topological order

    def module(self, node) -> Optional[nn.Module]:
        return self.mods.get(node.target) if node.op == "call_module" else None

    def passes(self, node, mixing: bool) -> bool:
        m = self.module(node)
        if m is not None:
            return _per_channel(m) or (mixing and isinstance(m, (nn.Conv2d, nn.Linear)))
        if node.op == "call_function":
            return node.target in _PASS_FUNCTIONS
        if node.op == "call_method":
            return node.target in _PASS_METHODS
        return False

    def ends_of_users(self, start, mixing: bool) -> Optional[Set]:
        """The normalisations every path from ``start`` ends at; None as soon as one escapes.
        Nodes are visited in graph order, so an add is judged after every summand that ``start``
        reaches has been."""
        reached, ends, queued, heap, below = {start}, set(), set(), [], set()
        self._queue_users(start, queued, heap)
        while heap:
            _, node = heapq.heappop(heap)
            if isinstance(self.module(node), _NORMS):
                ends.add(node)
                continue
            if not (node.users and self.passes(node, mixing) and self._summands_from(node, start, reached, below)):
                return None
            reached.add(node)
            self._queue_users(node, queued, heap)
        return ends

    def _summands_from(self, node, start, reached: Set, below: Set) -> bool:
        """An add's operands all come from ``start`` (``_ADDS``): reached along the path, or
        below it (``below``: its descendants, filled on first need); any other node: true."""
        if not (node.op == "call_function" and node.target in _ADDS):
            return True
        # a literal 0 adds nothing (timm's MobileOne sums its branches onto 0); another constant
        # is not rescaled with the start
        summands = [a for a in node.args if not _literal_zero(a)]
        if node.kwargs or not all(isinstance(a, torch.fx.Node) for a in summands):
            return False
        if all(a in reached for a in summands):
            return True
        if not below:
            below |= self._descendants(start)
        return all(a in reached or a in below for a in summands)

    def _descendants(self, start) -> Set:
        """Every node computed from ``start``'s values. Past the path's reached nodes (whose
        users all pass or end it, else the path escaped first) only through its ends."""
        seen, stack = set(), [start]
        while stack:
            for u in _data_users(stack.pop()):
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
        return seen

    def _queue_users(self, node, queued: Set, heap: list) -> None:
        for u in _data_users(node):
            if u not in queued:
                queued.add(u)
                heapq.heappush(heap, (self.order[u], u))

    def batchnorm1d_reached(self, node) -> Set:
        """The BatchNorm1d nodes some path from ``node`` reaches through single-input
        per-channel ops (no add or concat with other data on the way). Other paths may escape."""
        stack, seen, reached = list(_data_users(node)), set(), set()
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            m = self.module(u)
            if isinstance(m, nn.BatchNorm1d):
                reached.add(u)
                continue
            if not isinstance(m, _NORMS) and self.passes(u, False) and not (
                    u.op == "call_function" and u.target in _MERGES):
                stack.extend(_data_users(u))
        return reached
