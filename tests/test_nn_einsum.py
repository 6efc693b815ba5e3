"""Mesa ``Einsum`` (mesa_train/nn/einsum.py) and its routing from MViTv2's and SAM's attention:
the stock forward bit for bit, 8-bit copies of the large operands, a small position table kept
as it is, and gradients that are the contraction's at the kept operands (compiled: the same)."""
import copy
import sys
from pathlib import Path

import pytest
import torch

from mesa_train.memory import SavedTensorMeter
from mesa_train.nn import Einsum, input_copy
from mesa_train.nn.quantizer import decompress
from mesa_train.patch import patch_model

sys.path.insert(0, str(Path(__file__).parent))
from timm_zoo import build, example  # noqa: E402

EQUATION = "byhwc,hkc->byhwk"  # MViTv2's cal_rel_pos_type


def _operands(batch=4, heads=2, h=5, w=6, c=8, k=7):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, h, w, c, generator=g)
    table = torch.randn(h, k, c, generator=g)
    return q, table


def test_bitwise_forward_and_gradients_at_the_kept_operands():
    layer = Einsum(num_groups=2)
    before = copy.deepcopy(layer)  # its quantizers' state before the call
    q, table = _operands()
    qm, tm = q.clone().requires_grad_(), table.clone().requires_grad_()
    with SavedTensorMeter() as meter:
        out = layer(EQUATION, qm, tm)
    assert torch.equal(out, torch.einsum(EQUATION, q, table))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(g)
    # the reference: autograd through the einsum at the 8-bit q the layer kept and the exact table
    qh = decompress(before.quantizer_a.compress(q, 1), q.dtype).requires_grad_()
    tr = table.clone().requires_grad_()
    torch.einsum(EQUATION, qh, tr).backward(g)
    torch.testing.assert_close(qm.grad, qh.grad, rtol=0, atol=0)  # dq needs only the exact table
    torch.testing.assert_close(tm.grad, tr.grad, rtol=1e-5, atol=1e-5)
    # kept: q's codes (one byte an element, plus statistics) and the table as it is
    assert meter.activation_bytes < q.numel() + table.nbytes + 1024
    qs, ts = q.clone().requires_grad_(), table.clone().requires_grad_()
    torch.einsum(EQUATION, qs, ts).backward(g)
    for got, want in ((qm.grad, qs.grad), (tm.grad, ts.grad)):
        assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9999


def test_both_compressed_when_alike_and_stock_when_off():
    a = torch.randn(6, 5, 4, requires_grad=True)
    b = torch.randn(6, 4, 5, requires_grad=True)
    with SavedTensorMeter() as meter:
        Einsum(num_groups=1)("bij,bjk->bik", a, b)
    assert meter.activation_bytes < 0.5 * (a.nbytes + b.nbytes)
    with SavedTensorMeter() as meter:
        Einsum(enabled=False)("bij,bjk->bik", a, b)
    assert meter.activation_bytes >= a.nbytes + b.nbytes


def test_mvitv2_rel_pos_routed():
    stock = build("mvitv2_tiny")
    patched = patch_model(copy.deepcopy(stock))
    owners = [n for n, m in patched.named_modules() if isinstance(m, Einsum)]
    assert owners and all(n.endswith("attn.mesa_einsum") for n in owners)
    x = example("mvitv2_tiny")
    torch.manual_seed(0)
    ys = stock(x)
    torch.manual_seed(0)
    assert torch.equal(ys, patched(x))
    with SavedTensorMeter(patched) as m_patched:
        patched(x)
    no_einsum = copy.deepcopy(patched)  # the same patch, its einsum children switched off
    for m in no_einsum.modules():
        if isinstance(m, Einsum):
            m.set_quant_options(enabled=False)
    with SavedTensorMeter(no_einsum) as m_without:
        no_einsum(x)
    assert m_patched.activation_bytes < 0.9 * m_without.activation_bytes


def test_sam_explicit_path_routed():
    """SAM's attention with ``fused_attn=False``: the bias's einsums run through the child."""
    stock = build("samvit_base_patch16")
    for m in stock.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    patched = patch_model(copy.deepcopy(stock))
    calls = []
    for m in patched.modules():
        if isinstance(m, Einsum):
            m.register_forward_hook(lambda *a: calls.append(1))
    x = example("samvit_base_patch16")
    assert torch.equal(stock(x), patched(x))
    assert len(calls) == 2 * 2  # two einsums in each of the two blocks


@pytest.mark.parametrize("equation,ok", [("byhwc,hkc->byhwk", True), ("bij,bjk->bik", True),
                                         ("ij,jk->k", False), ("...ij,jk->...ik", False), ("ii,ij->j", False),
                                         ("ij,jk,kl->il", False), ("ij,jk", False)])
def test_contractions_with_einsum_gradients_only(equation, ok):
    """Other equations (a letter summed inside one operand, ``...``, repeats, three operands,
    an implicit output) run the stock einsum: nothing compressed, stock's gradients."""
    from mesa_train.nn.einsum import contraction

    assert (contraction(equation) is not None) == ok


def test_compiled_matches_eager_bitwise():
    """The backward is two einsums (traceable): compiled, the same codes and the same steps."""
    stock = build("mvitv2_tiny")
    patched = patch_model(copy.deepcopy(stock))
    compiled = copy.deepcopy(patched)  # the quantizer state the eager call starts from
    x = example("mvitv2_tiny")
    with input_copy.disabled():  # (compiled graphs keep each parallel layer's own copy)
        y = patched(x)
        y.sum().backward()
    yc = torch.compile(compiled, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(y, yc)
    yc.sum().backward()
    for (n, p), c in zip(patched.named_parameters(), compiled.parameters()):
        assert torch.equal(p.grad, c.grad), n
