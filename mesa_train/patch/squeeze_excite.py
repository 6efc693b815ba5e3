"""Mesa forwards for timm's and torchvision's squeeze-excite blocks, installed like the gated
MLPs (``mlp.py``).

The instance's class is swapped for a subclass whose forward is the stock one line for line,
except that the final ``x * self.gate(x_se)`` runs through a ``mesa_gate`` child
(:class:`mesa_train.nn.ChannelGate`: 8-bit ``x``, one group per channel). The convs, norms
and activations of the squeeze path act on ``(N, C, 1, 1)`` tensors and are converted (or
not) by the ordinary leaf conversion. The same for the channel gates of ECA, legacy SENet,
Selective Kernel and ResNeSt's split attention (session 78; the last two weigh stacked paths
``(B, P, C, H, W)``, gated as ``(B, P * C, H, W)``: the same products), HGNet's ``EseModule`` and
GCNet's ``GlobalContext`` with ``fuse_scale`` (session 82; its softmax over the positions stays
stock: ``stock_position_softmax``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers.squeeze_excite import EffectiveSEModule as _EffectiveSE, SEModule as _SE
from timm.layers.squeeze_excite import SqueezeExciteCl as _SECl
from timm.layers.eca import CecaModule as _Ceca, EcaModule as _Eca
from timm.layers.global_context import GlobalContext as _GlobalContext
from timm.layers.selective_kernel import SelectiveKernel as _SelectiveKernel
from timm.layers.split_attn import SplitAttn as _SplitAttn
from timm.models.hgnet import EseModule as _HGNetEse
from timm.models.senet import SEModule as _LegacySE
from timm.models._efficientnet_blocks import SqueezeExcite as _EfficientNetSE
from torchvision.ops.misc import SqueezeExcitation as _TorchvisionSE

__all__ = ["SE_CLASSES", "STOCK_SE_CLASSES", "SE_CHILD", "gate_channels", "swaps", "stock_position_softmax"]

SE_CHILD = "mesa_gate"


class MesaEfficientNetSqueezeExcite(_EfficientNetSE):
    """EfficientNet / MobileNetV3 / GhostNet's ``SqueezeExcite``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_se = x.mean((2, 3), keepdim=True)
        x_se = self.conv_reduce(x_se)
        x_se = self.act1(x_se)
        x_se = self.conv_expand(x_se)
        return self.mesa_gate(x, self.gate(x_se))


class MesaSEModule(_SE):
    """``timm.layers.SEModule`` (alias ``SqueezeExcite``: RegNetY, LCNetV2, ReXNet, RepViT, SHViT)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_se = x.mean((2, 3), keepdim=True)
        if self.add_maxpool:
            x_se = 0.5 * x_se + 0.5 * x.amax((2, 3), keepdim=True)
        x_se = self.fc1(x_se)
        x_se = self.act(self.bn(x_se))
        x_se = self.fc2(x_se)
        return self.mesa_gate(x, self.gate(x_se))


class MesaEffectiveSEModule(_EffectiveSE):
    """``EffectiveSEModule`` (RDNet, CSPNeXt)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_se = x.mean((2, 3), keepdim=True)
        if self.add_maxpool:
            x_se = 0.5 * x_se + 0.5 * x.amax((2, 3), keepdim=True)
        x_se = self.fc(x_se)
        return self.mesa_gate(x, self.gate(x_se))


class MesaSqueezeExciteCl(_SECl):
    """``SqueezeExciteCl``: channels-last ``(N, H, W, C)`` tensors (the gate along the last dim)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_se = x.mean((1, 2), keepdims=True)
        x_se = self.fc1(x_se)
        x_se = self.act(x_se)
        x_se = self.fc2(x_se)
        return self.mesa_gate(x, self.gate(x_se))


class MesaTorchvisionSqueezeExcitation(_TorchvisionSE):
    """torchvision's ``SqueezeExcitation`` (its EfficientNet, MobileNetV3, RegNetY, MaxViT):
    ``scale * input``, a product that is commutative bit for bit."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.mesa_gate(input, self._scale(input))


class MesaEcaModule(_Eca):
    """``EcaModule`` (ECA-Net: timm's ``eca*`` ResNets and NFNets, ``attn_layer="eca"``): a 1-D conv
    across the pooled channels; ``x * y.expand_as(x)`` (the same products as ``x * y``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.mean((2, 3)).view(x.shape[0], 1, -1)
        y = self.conv(y)
        if self.conv2 is not None:
            y = self.act(y)
            y = self.conv2(y)
        y = self.gate(y).view(x.shape[0], -1, 1, 1)
        return self.mesa_gate(x, y)


class MesaCecaModule(_Ceca):
    """``CecaModule`` (``attn_layer="ceca"``): ECA with circular padding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.mean((2, 3)).view(x.shape[0], 1, -1)
        y = F.pad(y, (self.padding, self.padding), mode='circular')
        y = self.conv(y)
        y = self.gate(y).view(x.shape[0], -1, 1, 1)
        return self.mesa_gate(x, y)


class MesaLegacySEModule(_LegacySE):
    """``timm.models.senet.SEModule`` (the ``legacy_se*`` / ``legacy_senet`` models): ``module_input * x``."""

    def forward(self, x):
        module_input = x
        x = x.mean((2, 3), keepdim=True)
        x = self.fc1(x)
        x = self.relu(x)
        x = self.fc2(x)
        x = self.sigmoid(x)
        return self.mesa_gate(module_input, x)


class MesaHGNetEseModule(_HGNetEse):
    """HGNet's ``EseModule`` (PP-HGNet V1: ``hgnet_tiny`` / ``small`` / ``base``, each block's
    aggregation): ``torch.mul(identity, x)``."""

    def forward(self, x):
        identity = x
        x = x.mean((2, 3), keepdim=True)
        x = self.conv(x)
        x = self.sigmoid(x)
        return self.mesa_gate(identity, x)


class MesaGlobalContext(_GlobalContext):
    """``GlobalContext`` with ``fuse_scale`` (``attn_layer="gc"``: ``gc_efficientnetv2_rw_t``, a
    model built with ``attn_layer="gc"``; timm's ``gcresnet*`` / ``gcresnext*`` use ``"gca"``, no
    gate, and are not swapped): ``x * self.gate(mlp_x)`` through ``mesa_gate``. Its
    attention pooling (``x @ softmax(conv_attn(x))`` over the positions) is the generic attention
    capture's q.k product, as before (``patch/generic_attention.py``); the softmax stays stock
    (``stock_position_softmax``)."""

    def forward(self, x):
        B, C, H, W = x.shape

        if self.conv_attn is not None:
            attn = self.conv_attn(x).reshape(B, 1, H * W)  # (B, 1, H * W)
            attn = F.softmax(attn, dim=-1).unsqueeze(3)  # (B, 1, H * W, 1)
            context = x.reshape(B, C, H * W).unsqueeze(1) @ attn
            context = context.view(B, C, 1, 1)
        else:
            context = x.mean(dim=(2, 3), keepdim=True)

        if self.mlp_scale is not None:
            mlp_x = self.mlp_scale(context)
            x = self.mesa_gate(x, self.gate(mlp_x))
        if self.mlp_add is not None:
            mlp_x = self.mlp_add(context)
            x = x + mlp_x

        return x


class MesaSelectiveKernel(_SelectiveKernel):
    """``SelectiveKernel`` (SKNet: ``skresnet*``): the paths stacked ``(B, P, C, H, W)`` times their
    softmax weights ``(B, P, C, 1, 1)``, as ``(B, P * C, H, W)`` times ``(B, P * C, 1, 1)`` (the same
    products, one group per path and channel)."""

    def forward(self, x):
        if self.split_input:
            x_split = torch.split(x, self.in_channels // self.num_paths, 1)
            x_paths = [op(x_split[i]) for i, op in enumerate(self.paths)]
        else:
            x_paths = [op(x) for op in self.paths]
        x = torch.stack(x_paths, dim=1)
        x_attn = self.attn(x)
        x = self.mesa_gate(x.flatten(1, 2), x_attn.flatten(1, 2)).view(x.shape)
        x = torch.sum(x, dim=1)
        return x


class MesaSplitAttn(_SplitAttn):
    """``SplitAttn`` (ResNeSt): the radix groups times their attention, as ``(B, R * C, H, W)``
    times ``(B, R * C, 1, 1)`` (the same products), then summed over the radix as stock sums."""

    def forward(self, x):
        x = self.conv(x)
        x = self.bn0(x)
        x = self.drop(x)
        x = self.act0(x)

        B, RC, H, W = x.shape
        if self.radix > 1:
            x = x.reshape((B, self.radix, RC // self.radix, H, W))
            x_gap = x.sum(dim=1)
        else:
            x_gap = x
        x_gap = x_gap.mean((2, 3), keepdim=True)
        x_gap = self.fc1(x_gap)
        x_gap = self.bn1(x_gap)
        x_gap = self.act1(x_gap)
        x_attn = self.fc2(x_gap)

        x_attn = self.rsoftmax(x_attn).view(B, -1, 1, 1)
        if self.radix > 1:
            out = self.mesa_gate(x.flatten(1, 2), x_attn).view(x.shape).sum(dim=1)
        else:
            out = self.mesa_gate(x, x_attn)
        return out.contiguous()


SE_CLASSES = {_EfficientNetSE: MesaEfficientNetSqueezeExcite, _SE: MesaSEModule, _EffectiveSE: MesaEffectiveSEModule,
              _SECl: MesaSqueezeExciteCl, _TorchvisionSE: MesaTorchvisionSqueezeExcitation,
              _Eca: MesaEcaModule, _Ceca: MesaCecaModule, _LegacySE: MesaLegacySEModule, _HGNetEse: MesaHGNetEseModule,
              _SelectiveKernel: MesaSelectiveKernel, _SplitAttn: MesaSplitAttn, _GlobalContext: MesaGlobalContext}
STOCK_SE_CLASSES = {v: k for k, v in SE_CLASSES.items()}


def gate_channels(module) -> int | None:
    """The channel count of a stock squeeze-excite block's input, or None where the block does
    not record it (ECA: its conv runs across the pooled channels, whatever their count)."""
    if isinstance(module, (_Eca, _Ceca)):
        return None
    if isinstance(module, _SelectiveKernel):
        return module.attn.fc_select.out_channels  # (paths x channels)
    if isinstance(module, _SplitAttn):
        return module.fc2.out_channels  # (radix x channels)
    if isinstance(module, _HGNetEse):
        return module.conv.in_channels
    if isinstance(module, _GlobalContext):
        return module.mlp_scale.fc1.in_channels
    first = getattr(module, "conv_reduce", None) or getattr(module, "fc1", None) or module.fc
    return first.in_features if isinstance(module, _SECl) else first.in_channels


def swaps(module) -> bool:
    """Whether a stock block's swapped forward has a product to take: all but a ``GlobalContext``
    without ``fuse_scale`` (timm's ``"gca"``: it adds its context, no gate)."""
    return not isinstance(module, _GlobalContext) or module.mlp_scale is not None


def stock_position_softmax(module) -> bool:
    """A ``GlobalContext`` (stock or swapped): its softmax over the positions stays stock when the
    generic attention capture takes its pooling product. The map is ``(B, 1, H * W)``, 1/C of
    ``x``'s size, and often saturated (one position near 1): in 8 bits its small probabilities
    round away, and ``conv_attn``'s weight gradients read cosines 0.00-0.32 against float64 in
    three of ``gc_efficientnetv2_rw_t``'s blocks at 64 px (0.99-1.00 with it stock)."""
    return isinstance(module, _GlobalContext)
