"""Scale branches (RepVGG, MobileOne, FastViT, RepViT, GhostNetV3): a 1x1 depthwise conv straight
into a train-mode BatchNorm, converted as a pair and linked.

The conv's weight gradient is a cancellation (the BatchNorm's scale invariance makes it zero but
for eps) that only the link's closed form gets right (``mesa_train.nn.conv.ScaleLink``): from an
8-bit input under a stock BatchNorm, or under a Mesa BatchNorm's 8-bit ``x_hat`` above a stock
conv, it is noise (mobileone_s0 with ``ops=["conv"]`` alone: cosine 0.45 to float64 stock's at
worst; 0.68 on a test block with ``ops=["batchnorm"]`` alone). So a call asking for one of the
two ops leaves the pair stock and marks the half it would have converted as *waiting*, with the
Mesa class and options it would have had; the call that converts the other half converts the
waiting one too and links them. ``patch_model(m, ops=["conv"], bits=4)`` then
``patch_model(m, ops=["batchnorm"])`` gives the scale convs 4 bits and links every pair."""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

from timm.layers import BatchNormAct2d, ConvNormAct
from timm.models.ghostnet import ConvBnAct as GhostConvBnAct
from torch import nn

import mesa_train.nn as mnn
from mesa_train.nn.conv import is_scale_conv

from .replace import Parents, replace_child

__all__ = ["WAITING_ATTR", "convs_of_kept_norms", "halves_to_wait", "link_scale_branches", "scale_pairs",
           "waiting_halves"]

# on a stock half kept for its pair: (Mesa class, its quantization options); in __dict__ only, so
# the module tree and state_dict are stock's. A later call asking for its op again puts its
# explicit options over them, as over a layer converted before
WAITING_ATTR = "_mesa_pair_waiting"


def _conv_norm_attrs(m: nn.Module) -> Optional[Tuple[str, str]]:
    """The ``(conv, norm)`` attribute names of a timm module whose forward feeds its conv's output
    to its norm and to nothing else: ``ConvNormAct`` with no anti-aliasing (FastViT / MobileOne
    ``conv_scale``) and ghostnet's ``ConvBnAct`` (GhostNetV3 ``cheap_rpr_scale`` /
    ``dw_rpr_scale``: ``aa`` and the optional skip add come after ``bn1``)."""
    if type(m) is ConvNormAct and getattr(m, "aa", None) is None:
        return "conv", "bn"
    if type(m) is GhostConvBnAct:
        return "conv", "bn1"
    return None


def _conv_into_norm(m: nn.Module):
    """``(conv, bn)`` when ``m`` runs ``bn(conv(x))`` (then maybe more on the BatchNorm's output):
    an ``nn.Sequential`` of those two (RepViT ``ConvNorm``) or a timm conv-norm module
    (``_conv_norm_attrs``), whose ``BatchNormAct2d`` has no dropout / activation."""
    kids = list(m._modules.values())
    attrs = _conv_norm_attrs(m)
    if isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward and len(kids) == 2:
        conv, bn = kids
    elif attrs is not None:
        conv, bn = (getattr(m, a) for a in attrs)
    else:
        return None
    if isinstance(bn, (BatchNormAct2d, mnn.BatchNormAct2d)) and not (
            type(bn.drop) is nn.Identity and type(bn.act) is nn.Identity):
        return None
    stock_forward = (nn.BatchNorm2d.forward, BatchNormAct2d.forward)
    if not (isinstance(bn, mnn.BatchNorm2d) or (isinstance(bn, nn.BatchNorm2d) and type(bn).forward in stock_forward)):
        return None
    return conv, bn


def scale_pairs(root: nn.Module) -> Iterator[Tuple[nn.Module, nn.Module]]:
    """Every scale branch under ``root`` as ``(conv, bn)``: a 1x1 depthwise conv
    (``is_scale_conv``) whose output is its BatchNorm's input and nothing else's."""
    for m in root.modules():
        pair = _conv_into_norm(m)
        if pair is not None and is_scale_conv(pair[0]) and pair[1].num_features == pair[0].out_channels:
            yield pair


def halves_to_wait(root: nn.Module, op_names) -> Dict[int, str]:
    """The halves a call asking for only one of ``conv`` and ``batchnorm`` keeps stock, as
    ``{id: name}``: the scale convs whose BatchNorm is stock, or the reverse, unless that partner
    waits for this call (an earlier call kept it: both are converted now, ``link_scale_branches``).
    The leaf pass marks each of them waiting (``WAITING_ATTR``) instead of converting it. The cost
    while they wait: with ``conv``, few bytes (the convs beside them in a RepVGG / MobileOne block
    read the same input; mobileone_s0 the same bytes); with ``batchnorm``, the stock BatchNorms
    keep their inputs (mobileone_s0: 0.536x of stock's bytes against 0.481x)."""
    convs, norms = "conv" in op_names, "batchnorm" in op_names
    if convs == norms:
        return {}
    names = {id(m): n for n, m in root.named_modules()}
    kept = {}
    for conv, bn in scale_pairs(root):
        if convs and not isinstance(bn, mnn.BatchNorm2d) and WAITING_ATTR not in bn.__dict__:
            kept[id(conv)] = names[id(conv)]
        if norms and not isinstance(conv, mnn.Conv2d) and WAITING_ATTR not in conv.__dict__:
            kept[id(bn)] = names[id(bn)]
    return kept


def convs_of_kept_norms(root: nn.Module, kept: Dict[int, str]) -> Dict[int, str]:
    """The scale convs whose BatchNorm stays stock for good (``kept``: the cancellation analysis'
    BatchNorms, ``patch/cancellation.py``), as ``{id: name}``: a stock BatchNorm cannot hand its
    conv the closed-form weight gradient, and the 8-bit input swamps that cancellation
    (MobileOne-S1's ``conv_scale`` after a single-branch block), so the conv stays stock too: its
    full input gives stock's gradient."""
    names = {id(m): n for n, m in root.named_modules()}
    return {id(conv): names[id(conv)] for conv, bn in scale_pairs(root) if id(bn) in kept}


def link_scale_branches(root: nn.Module, parents: Parents, keep_stock=()) -> None:
    """Convert each waiting half whose partner is now Mesa (with the class and options its own
    call gave it; not one this call keeps stock, ``keep_stock``), then link every pair of Mesa
    halves: the conv takes its weight gradient from its BatchNorm (``nn/conv.py``). Also links a
    pair converted by hand."""
    for conv, bn in list(scale_pairs(root)):
        if isinstance(conv, mnn.Conv2d) and not isinstance(bn, mnn.BatchNorm2d):
            bn = _convert_waiting(parents, bn, conv, keep_stock)
        elif isinstance(bn, mnn.BatchNorm2d) and not isinstance(conv, mnn.Conv2d):
            conv = _convert_waiting(parents, conv, bn, keep_stock)
        if isinstance(conv, mnn.Conv2d) and isinstance(bn, mnn.BatchNorm2d):
            conv.__dict__["_mesa_scale_bn"] = bn  # not a child: state_dict and module tree unchanged
            bn.__dict__["_mesa_scale_conv"] = conv  # (under torch.compile the BatchNorm runs the pair: nn/batchnorm.py)


def _convert_waiting(parents: Parents, half: nn.Module, partner: nn.Module, keep_stock) -> nn.Module:
    """``half`` converted as its call would have, if it waits for its partner; else ``half``. A
    parameter-free half (a BatchNorm without affine) gets its partner's device, where the model
    is now."""
    waiting = half.__dict__.get(WAITING_ATTR)
    if waiting is None or id(half) in keep_stock:
        return half
    mesa_cls, options = waiting
    kw = {}
    if not any(True for _ in half.parameters(recurse=False)):
        kw["device"] = next(partner.parameters()).device
    new = mesa_cls.from_module(half, **kw, **options)
    replace_child(parents, half, new)
    return new


def waiting_halves(root: nn.Module, kept_for_good=()) -> List[str]:
    """The names of the stock halves still waiting for their partner's op (``describe``); not
    those whose partner is in ``kept_for_good`` (names: the BatchNorms the cancellation analysis
    keeps stock, which no op converts; the mark stays, for a ``cancelling_bn="compress"`` call)."""
    names = {id(m): n for n, m in root.named_modules()}
    return [names[id(half)] for conv, bn in scale_pairs(root) for half, partner in ((conv, bn), (bn, conv))
            if WAITING_ATTR in half.__dict__ and not isinstance(half, mnn.MesaLayer)
            and names[id(partner)] not in kept_for_good]
