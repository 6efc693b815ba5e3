"""Saved activation bytes of patched models (SavedTensorMeter), printed like paper Tables 7/8.

DeiT-Ti is the real ``deit_tiny_patch16_224`` (width 192, 3 heads, depth 12, 224x224,
197 tokens) at batch 2: the ratios depend on the token count and the widths, not on the
batch size. Targets (issue 3): all ops, fp32, explicit attention: <= 30% of the stock
explicit model; the same under bf16 autocast: <= 55%; with ``sdpa`` (fused attention kept)
the ratio against the stock fused model is printed and must be < 1.
"""
import pytest
import timm
import torch

from mesa_train.patch.report import (MODULE_CONFIGS, OP_CONFIGS, SDPA_CONFIGS, Config, format_saved_bytes_table,
                                     saved_bytes_rows)

from test_patch_helpers import build, inputs


def _deit():
    return timm.create_model("deit_tiny_patch16_224", pretrained=False, drop_path_rate=0.0)


@pytest.fixture(scope="module")
def deit_x():
    return torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))


def _by_label(rows):
    return {r["label"]: r for r in rows}


def test_deit_ti_fp32_tables(deit_x):
    rows = saved_bytes_rows(_deit, deit_x, OP_CONFIGS + MODULE_CONFIGS + SDPA_CONFIGS)
    print("\n" + format_saved_bytes_table(rows, "DeiT-Ti 224x224, batch 2, fp32: saved activation bytes "
                                                "(Table 7: per op; Table 8: per module set; sdpa)"))
    r = _by_label(rows)
    assert r["all (explicit attn)"]["vs_explicit"] <= 0.30
    assert r["all ops, all modules"]["vs_explicit"] <= 0.30
    for label in ("linear", "matmul", "softmax", "gelu", "layernorm", "conv",
                  "all ops, msa", "all ops, ffn", "all ops, msa+ffn", "all ops, other"):
        assert r[label]["vs_explicit"] < 1.0, label
    # softmax only: the map is kept once, as the Softmax's uint8 copy (attn @ v reuses it and
    # keeps v as stock does): exactly 3 of its 4 bytes per element saved, minus the stats
    B, H, N, depth = 2, 3, 197, 12
    saved = r["stock (explicit attn)"]["activation_bytes"] - r["softmax"]["activation_bytes"]
    assert saved == depth * (B * H * N * N * 3 - 2 * H * 4), saved
    assert r["all ops, msa+ffn"]["activation_bytes"] < min(r["all ops, msa"]["activation_bytes"],
                                                          r["all ops, ffn"]["activation_bytes"])
    for c in SDPA_CONFIGS:
        print(f"{c.label}: {r[c.label]['vs_fused']:.1%} of stock fused attention")
        assert r[c.label]["vs_fused"] < 1.0


def test_deit_ti_bf16(deit_x):
    configs = [Config("all (explicit attn)", ("all",))] + SDPA_CONFIGS
    rows = saved_bytes_rows(_deit, deit_x, configs, autocast_dtype=torch.bfloat16)
    print("\n" + format_saved_bytes_table(rows, "DeiT-Ti 224x224, batch 2, bf16 autocast"))
    r = _by_label(rows)
    assert r["all (explicit attn)"]["vs_explicit"] <= 0.55
    for c in SDPA_CONFIGS:
        assert r[c.label]["vs_fused"] < 1.0


@pytest.mark.parametrize("name", ["swin", "pvt"])
def test_tiny_swin_pvt_tables(name):
    configs = OP_CONFIGS + [MODULE_CONFIGS[-1]] + SDPA_CONFIGS
    rows = saved_bytes_rows(lambda: build(name), inputs(name), configs)
    print("\n" + format_saved_bytes_table(rows, f"tiny {name} (tests/test_patch_helpers.py), fp32"))
    r = _by_label(rows)
    assert r["all (explicit attn)"]["vs_explicit"] < 0.45
    for c in SDPA_CONFIGS:
        assert r[c.label]["vs_fused"] < 1.0
