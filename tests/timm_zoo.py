"""timm model zoo for the per-model checks (tests/test_timm_models.py): one small variant per
family, shrunk through ``timm.create_model`` kwargs (depth, image size) so a forward and
backward takes well under a second on one CPU core.

``ZOO``: name -> (create_model kwargs, input image size). ``QUICK``: the CI subset.
"""
from __future__ import annotations

import torch
import timm

V = dict(img_size=32, patch_size=8, depth=2)
ZOO = {
    "vit_tiny_patch16_224": (V, 32),
    "deit_tiny_distilled_patch16_224": (V, 32),
    "deit3_small_patch16_224": (dict(V, embed_dim=64, num_heads=2), 32),
    "vit_base_patch16_clip_quickgelu_224": (dict(V, embed_dim=64, num_heads=2), 32),
    "vit_base_patch16_xp_224": (dict(V, embed_dim=64, num_heads=2), 32),
    "vit_relpos_small_patch16_224": (dict(V, embed_dim=64, num_heads=2), 32),
    "vit_small_patch16_rope_224": (dict(V, embed_dim=64, num_heads=2), 32),
    "vit_base_patch16_siglip_224": (dict(V, embed_dim=64, num_heads=2), 32),
    "vit_little_patch16_reg1_gap_256": (dict(V, embed_dim=64, num_heads=2), 32),
    "vit_small_patch16_dinov3": (dict(V, embed_dim=64, num_heads=2), 32),
    "naflexvit_base_patch16_gap": (dict(V, embed_dim=64, num_heads=2), 32),
    "eva02_tiny_patch14_224": (dict(V, embed_dim=64, num_heads=2), 32),
    "beit_base_patch16_224": (dict(V, embed_dim=64, num_heads=2), 32),
    "beitv2_base_patch16_224": (dict(V, embed_dim=64, num_heads=2), 32),
    "cait_xxs24_224": (dict(V, depth_token_only=1), 32),
    "xcit_nano_12_p16_224": (dict(img_size=32, depth=2), 32),
    "convit_tiny": (dict(img_size=32, patch_size=8, depth=2, local_up_to_layer=1), 32),
    "tnt_s_patch16_224": (dict(img_size=32, patch_size=8, depth=2), 32),
    "pit_ti_224": (dict(img_size=64), 64),
    "swin_tiny_patch4_window7_224": (dict(img_size=32, window_size=4, depths=(1, 1), num_heads=(1, 2), embed_dim=16),
                                     32),
    "swinv2_tiny_window8_256": (dict(img_size=32, window_size=4, depths=(1, 1), num_heads=(1, 2), embed_dim=16), 32),
    "swinv2_cr_tiny_ns_224": (dict(img_size=(32, 32), window_size=4, depths=(1, 1), num_heads=(1, 2), embed_dim=16),
                              32),
    "pvt_v2_b0": (dict(depths=(1, 1, 1, 1)), 64),
    "twins_svt_small": (dict(depths=(1, 1, 1, 1)), 64),
    "twins_pcpvt_small": (dict(depths=(1, 1, 1, 1)), 64),
    # 96 px, not 32: at 32 px stage 4 is 1x1 and stage 3 2x2 tokens, so each 5x5 tap of the crpe
    # depthwise convs sums at most 8 products and one unlucky 8-bit rounding decides its gradient
    # (worst cosine 0.968 at 32 px, 0.991 at 64, 0.997 at 96; stock fp32 exact at all sizes)
    "coat_lite_tiny": (dict(img_size=96), 96),
    "coat_tiny": (dict(img_size=32, serial_depths=(1, 1, 1, 1), parallel_depth=1), 32),
    "levit_128s": (dict(img_size=64), 64),
    "mvitv2_tiny": (dict(img_size=64), 64),
    "efficientformer_l1": (dict(), 224),
    "efficientformerv2_s0": (dict(img_size=64, depths=(1, 1, 1, 1)), 64),
    "fastvit_t8": (dict(layers=(1, 1, 1, 1)), 64),
    "efficientvit_m0": (dict(img_size=64), 64),
    "efficientvit_b0": (dict(), 64),
    "mobilevit_xxs": (dict(), 64),
    "mobilevitv2_050": (dict(), 64),
    "maxvit_nano_rw_256": (dict(img_size=64), 64),
    "coatnet_nano_rw_224": (dict(img_size=64), 64),
    "edgenext_xx_small": (dict(), 64),
    "nest_tiny": (dict(img_size=32, patch_size=2), 32),
    "davit_tiny": (dict(depths=(1, 1, 1, 1)), 64),
    "focalnet_tiny_srf": (dict(), 64),
    "gcvit_xxtiny": (dict(img_size=64), 64),
    "volo_d1_224": (dict(img_size=64), 64),
    "visformer_tiny": (dict(img_size=64, depth=(1, 1, 1)), 64),
    "tiny_vit_5m_224": (dict(depths=(1, 1, 1, 1)), 64),
    "hiera_tiny_224": (dict(img_size=64, stages=(1, 1, 1, 1)), 64),
    # 128 px: at 64 the last stage is 2x2 tokens, its 3x3 average pool the global mean, and the
    # head's gradient about constant over those 4 tokens, so each layer_scale1 channel's exact
    # gradient sum(g * (mean - x)) cancels to ~0 and the 8-bit x decides it (cosine 0.007; 0.9997 at 128)
    "poolformer_s12": (dict(), 128),
    "poolformerv2_s12": (dict(), 64),
    "convformer_s18": (dict(), 64),
    "caformer_s18": (dict(), 64),
    "convnext_atto": (dict(depths=(1, 1, 1, 1)), 64),
    "convnextv2_atto": (dict(depths=(1, 1, 1, 1)), 64),
    "mixer_s16_224": (dict(img_size=32), 32),
    "resmlp_12_224": (dict(img_size=32), 32),
    "gmlp_s16_224": (dict(img_size=32), 32),
    "resnet18": (dict(), 32),
    "regnetx_002": (dict(), 32),
    # 64 px: at 32 the last stages are 1x1 maps (a BatchNorm over 2 values per channel); since its
    # BatchNormAct2d layers are compressed the worst cosine is 0.992-0.994 over seeds (bn1 weights)
    "efficientnet_b0": (dict(), 64),
    "mobilenetv3_small_050": (dict(), 32),
    "repvit_m1": (dict(), 64),
    "ghostnet_050": (dict(), 32),
    "inception_next_tiny": (dict(depths=(1, 1, 1, 1)), 64),
    "mambaout_femto": (dict(depths=(1, 1, 1, 1)), 64),
    "starnet_s1": (dict(), 64),
    "hgnetv2_b0": (dict(), 64),
    "rdnet_tiny": (dict(), 64),
    "vitamin_small_224": (dict(img_size=64, depth=2), 64),
    "sequencer2d_s": (dict(layers=(1, 1, 1, 1)), 64),
    "csatv2": (dict(), 64),
    # families added 2026-12-01 (timm 1.0.31's newer ViTs, hybrids and attention CNNs)
    "crossvit_tiny_240": (dict(img_size=120, depth=((1, 1, 0),)), 120),
    "samvit_base_patch16": (dict(img_size=64, depth=2, embed_dim=64, num_heads=2, global_attn_indexes=(1,),
                                 window_size=2, neck_chans=32), 64),
    "vit_base_r26_s32_224": (dict(img_size=64, depth=2, embed_dim=64, num_heads=2), 64),
    "sam2_hiera_tiny": (dict(stages=(1, 1, 2, 1), global_att_blocks=(3,)), 64),
    "botnet26t_256": (dict(img_size=64), 64),
    "halonet26t": (dict(img_size=256), 256),
    "lambda_resnet26t": (dict(img_size=64), 64),
    "swiftformer_xs": (dict(), 64),
    "shvit_s1": (dict(), 64),
    "nextvit_small": (dict(depths=(1, 1, 5, 1)), 64),
    # 96 px: at 64 its last stage is 2x2 tokens and one LayerNorm bias whose exact gradient is
    # 1e-4 of the largest (a near-cancellation: its HSM-SSD softmax is shift-invariant) falls to
    # 0.957 by the 8-bit noise of a few samples; 0.9998 at 96 (every parameter)
    "efficientvim_m1": (dict(), 96),
    "iformer_t": (dict(), 64),
    "lowformer_b0": (dict(), 64),
    "fasternet_t0": (dict(), 64),
    "qwen3_vit_88m": (dict(img_size=32, depth=2, embed_dim=64, num_heads=2), 32),
    "gemma4_vit_167m": (dict(img_size=32, depth=2, embed_dim=64, num_heads=2), 32),
    "deepseek_vit_412m": (dict(img_size=28, depth=2, embed_dim=64, num_heads=2), 28),
    # its attention stages' MLPs end in a Dropout(0.1) by default (proj_drop_rate), which
    # drop_rate / drop_path_rate do not reach: off, so the gradient runs draw no masks
    "cpubone_nano": (dict(proj_drop_rate=0.0), 64),
    "lcnetv2_small": (dict(), 64),
    "convmixer_768_32": (dict(), 96),
    # added 2026-12-01 (session 45) with their layers: BiT's StdConv2d + GroupNormAct, ReLU6,
    # RegNetY's SEModule, TF 'SAME' padding
    "resnetv2_50x1_bit": (dict(), 64),
    "mobilenetv2_050": (dict(), 64),
    "regnety_002": (dict(), 64),
    "tf_efficientnet_b0": (dict(), 64),  # timm's Conv2dSame in every block
    # added 2026-12-06 (session 76) with ScaledStdConv2d: the NF family's weight-standardized
    # convs with a learned gain (they ran stock, reported as batchnorm/conv; 0.65x -> 0.31x)
    "test_nfnet": (dict(), 64),
    # (session 76) timm's SimpleNorm2d, x / std_c(x): it ran stock without a word (0.42x -> 0.23x)
    "convnext_zepto_rms": (dict(), 64),
}

# CI subset (2 CPU cores, a few minutes): plain ViT, DeiT3 (low-variance class token),
# CLIP (QuickGELU), EVA-02 (rope, SwiGLU, own attention), SwinV2 (in-place after a Linear),
# CoaT (shared module), a conv+BN hybrid with the generic fallback, ConvNeXt (LayerNorm2d).
QUICK = ("vit_tiny_patch16_224", "deit3_small_patch16_224", "vit_base_patch16_clip_quickgelu_224",
         "eva02_tiny_patch14_224", "swinv2_tiny_window8_256", "coat_tiny", "efficientvit_m0", "convnext_atto")

# regularisation switched on for the forward-equality check (timm's usual training values)
DROP = dict(drop_rate=0.1, drop_path_rate=0.1)


def build(name: str, seed: int = 0, drop: bool = False, **extra) -> torch.nn.Module:
    """The small variant of ``name`` in train mode. ``drop``: dropout / drop-path on (``DROP``)
    where the model takes those arguments; else set to 0 where it does (some model
    defaults have drop-path on, and the gradient checks compare runs whose random draws
    would differ)."""
    kwargs, _ = ZOO[name]
    kwargs = {**kwargs, **extra}
    rates = DROP if drop else {k: 0.0 for k in DROP}
    for keys in (("drop_rate", "drop_path_rate"), ("drop_path_rate",), ("drop_rate",), ()):
        try:
            torch.manual_seed(seed)
            return timm.create_model(name, num_classes=5, **kwargs, **{k: rates[k] for k in keys}).train()
        except TypeError:
            continue
    raise AssertionError("unreachable")


def example(name: str, batch: int = 2, seed: int = 1) -> torch.Tensor:
    _, img = ZOO[name]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, img, img, generator=g)
