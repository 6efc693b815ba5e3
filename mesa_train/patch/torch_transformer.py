"""torch's ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` built with a string
activation (``activation="gelu"``, the form most code uses; ``"relu"`` is the default) keep the
function itself, ``self.activation = F.gelu``, and call ``self.activation(x)``: no module for the
leaf conversion to reach, and a call the source scan reads as a method. Left alone, the MLP's
widest activation stayed uncompressed and unreported (a small encoder stack kept 0.391 of
stock's bytes; 0.301 built with ``activation=nn.GELU()``, as now with ``"gelu"``).

``activations_as_modules`` swaps that function for the stock module that computes the same
(``nn.GELU()`` calls ``F.gelu(x)``, ``nn.ReLU()`` ``F.relu(x)``: the same bits), which the
leaf conversion then makes a Mesa layer with the layer's module set and options. The
inference fast path (``activation_relu_or_gelu``) reads a flag set at construction, which the
swap keeps; stock's own ``isinstance(activation, nn.GELU)`` sets the same flag. Since session 74
any module holding ``F.gelu`` / ``F.relu`` as an attribute that its forward only calls with the
input (vit-pytorch's CCT encoder layer: 0.407 -> 0.356 of stock bytes) gets the same swap.
"""
from __future__ import annotations

from typing import Iterable

import torch.nn.functional as F
from torch import nn

from .rules import plain_attribute_calls

__all__ = ["activations_as_modules"]

# the functions the torch layers store, the stock module computing the same, and its op
_AS_MODULE = {F.gelu: (nn.GELU, "gelu"), F.relu: (nn.ReLU, "relu")}
_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def activations_as_modules(root: nn.Module, op_names: Iterable[str]) -> None:
    """Give each torch transformer layer under ``root`` whose ``activation`` is ``F.gelu`` or
    ``F.relu`` the stock module instead, where that op is among ``op_names``; and any other
    module holding one of them as an attribute its forward only calls as ``self.<attr>(x)``
    (vit-pytorch's CCT: ``self.activation = F.gelu``), checked on its source
    (``rules.plain_attribute_calls``: a call with ``approximate=`` or ``inplace=`` would not fit
    the module's ``forward(input)``)."""
    ops = set(op_names)
    for m in root.modules():
        names = ("activation",) if isinstance(m, _LAYERS) else tuple(vars(m))
        for name in names:
            fn = vars(m).get(name)
            made = next((v for f, v in _AS_MODULE.items() if fn is f), None)  # (identity: fn may be unhashable)
            if made is None or made[1] not in ops:
                continue
            if isinstance(m, _LAYERS) or plain_attribute_calls(type(m), name):
                setattr(m, name, made[0]())  # (nn.Module's __setattr__ drops the plain attribute)
