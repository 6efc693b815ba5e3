"""``coverage``'s duplicated copies: a Mesa layer whose compressed tensor another module keeps
in full anyway adds bytes instead of saving them (``ops=["conv"]`` alone on a ReLU convnet:
stock ReLUs keep their outputs, the convs' inputs). The report names those layers, what keeps
their tensors, and the ops that would compress it."""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from mesa_train.memory import SavedTensorMeter
from mesa_train.patch import describe, patch_model
from mesa_train.patch.coverage import coverage
from timm_zoo import build, example


def _convnet():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1)).train()


def _x():
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def test_convs_after_stock_relus_are_reported_with_the_op_to_ask():
    """Two of the three convs read a stock ReLU's output (the first reads the image, which
    nothing keeps): their copies are duplicates, all their bytes, and the model keeps more
    than stock. Asking for relu too, or for all ops, leaves none."""
    model = patch_model(_convnet(), ops=["conv"])
    cov = coverage(model, _x())
    assert cov.ratio > 1
    assert len(cov.duplicated) == 1
    op, layers, nbytes, keepers, ops = cov.duplicated[0]
    assert (op, layers, keepers, ops) == ("conv", 2, {"ReLU": 2}, ("relu",))
    with SavedTensorMeter(model) as meter:
        model(_x())
    assert nbytes == meter.per_module["3"] + meter.per_module["6"]  # the two convs' own bytes
    assert "duplicated: 2 conv layers keep" in describe(model, _x())
    assert "(ReLU 2): ask for relu too" in describe(model, _x())
    for ops in (["conv", "relu"], ["all"]):
        cov = coverage(patch_model(_convnet(), ops=ops), _x())
        assert not [r for r in cov.duplicated if r[0] == "conv"], ops
        assert cov.ratio < 1


def test_an_op_already_asked_is_not_suggested():
    """The ReLUs patched in a first call: the conv rows of a later ``coverage`` cannot be their
    duplicates, and a stock keeper whose op the patch asked (a scale conv waiting for its
    BatchNorm) is named without being suggested."""
    model = patch_model(_convnet(), ops=["relu"])
    patch_model(model, ops=["conv"])
    assert not coverage(model, _x()).duplicated


def test_savers_of_names_every_saver_while_the_storage_lives():
    """``savers_of``: every module that saved a storage (the meter counts it once), ``<outside>``
    for a function called in no module, none for a storage nobody saved; a freed storage is
    nobody's, whatever tensor takes its address later (new tensors of its size, one likely at
    that address, read none)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with SavedTensorMeter(model) as meter:
        x = torch.randn(3, 4)
        h = model[0](x)
        model[1](h)  # (saves h, its input)
        y = torch.sigmoid(h)  # saves y, in no module
        assert meter.savers_of(x) == {"0"} and meter.savers_of(h) == {"1"}
        assert meter.savers_of(y) == {"<outside>"}
        z = model[1](y)  # a second saver of y
        assert meter.savers_of(y) == {"<outside>", "1"}
        assert meter.savers_of(torch.randn(3, 4)) == set()
        del x, h, y, z  # (the graph with them)
        later = [torch.randn(3, 4) for _ in range(8)]
        assert [meter.savers_of(t) for t in later] == [set()] * 8


def test_vit_with_linear_only_reports_its_proj_under_fused_attention():
    """With ``ops=["linear"]`` a ViT's stock attention runs fused SDPA, which keeps its output;
    the attention's proj Linear reads that very storage when the output's transpose is
    contiguous: its 8-bit copy is a duplicate, and ``sdpa`` is the op to ask."""
    stock = build("vit_tiny_patch16_224")
    x = example("vit_tiny_patch16_224")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = patch_model(copy.deepcopy(stock), ops=["linear"])
    rows = {r[0]: r for r in coverage(model, x).duplicated}
    if "linear" in rows:  # (where this CPU's SDPA kernel lays its output out so)
        assert rows["linear"][4] == ("sdpa",) and set(rows["linear"][3]) == {"Attention"}
    assert not coverage(patch_model(copy.deepcopy(stock)), x).duplicated


class ChangedInPlaceAfter(nn.Module):
    """The conv's input is changed in place after the conv read it; the ReLU then keeps the new
    values: the conv's copy (of the old ones) duplicates nothing."""

    def __init__(self):
        super().__init__()
        self.pre, self.conv = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.pre(x)
        y = self.conv(h)
        h.add_(1)
        return y + self.act(h)


def test_values_changed_in_place_since_are_no_duplicate():
    """The review's find: storage identity alone called the conv's copy a duplicate of the
    ReLU's output; the tensor version tells them apart."""
    torch.manual_seed(0)
    model = patch_model(ChangedInPlaceAfter().train(), ops=["conv"])
    assert not coverage(model, _x()).duplicated


def _vit(fused: bool):
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=4).train()
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused
    return model


def test_the_stock_figure_is_the_model_as_built():
    """``ops=["softmax"]`` puts a fused timm attention on the explicit path (patch_model warns);
    coverage's stock figure is the fused model's bytes as built, not the explicit path's (which
    keeps an N x N map the stock model does not), and the attentions are back on their path
    afterwards; a model built explicit (the paper's baseline) is measured explicit."""
    x = torch.randn(2, 3, 32, 32)
    for fused in (True, False):
        stock = _vit(fused)
        with SavedTensorMeter(stock) as meter:
            stock(x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = patch_model(copy.deepcopy(stock), ops=["softmax"])
        moved = [w for w in caught if "the explicit path (ops softmax without sdpa)" in str(w.message)]
        assert len(moved) == (1 if fused else 0)
        with warnings.catch_warnings(record=True) as caught:  # (asked for: the paper's setting, no warning)
            warnings.simplefilter("always")
            patch_model(copy.deepcopy(stock), ops=["softmax", "sdpa"], attention="explicit")
        assert not [w for w in caught if "the explicit path" in str(w.message)]
        assert coverage(model, x).stock_total == meter.activation_bytes, fused
        assert all(m.mesa_attn_path == "explicit" and not m.fused_attn for m in model.modules()
                   if hasattr(m, "mesa_attn_path"))
