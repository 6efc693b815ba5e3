"""``describe`` on every patched model of the timm zoo: it reads each Mesa layer's own
attributes (a ``MatMul``'s operands, an ``Einsum``'s), so a new layer kind that shares an op
name with another must not break it (session 46's ``Einsum``, op ``matmul``, made it raise
``AttributeError`` on MViTv2 and SAM)."""
import sys
import warnings
from pathlib import Path

import pytest

from mesa_train.patch import describe, patch_model
from mesa_train.patch.core import mesa_layer_op

sys.path.insert(0, str(Path(__file__).parent))
from timm_zoo import ZOO, build, example  # noqa: E402


@pytest.mark.parametrize("name", list(ZOO))
def test_describe_lists_every_mesa_layer(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the patch's "functional ops not reached" notes
        patched = patch_model(build(name))
    text = describe(patched)
    layers = [n for n, m in patched.named_modules() if mesa_layer_op(m) is not None]
    assert layers
    listed = {line.split()[0] for line in text.splitlines() if line.strip()}
    missing = [n for n in layers if n not in listed]
    assert not missing, missing[:5]


@pytest.mark.parametrize("name", ["mvitv2_tiny", "samvit_base_patch16"])
def test_describe_with_example_labels_the_einsum_layers(name):
    """With an example input (one measured forward) too; the rel-pos einsums are labelled."""
    patched = patch_model(build(name))
    text = describe(patched, example(name, batch=2))
    assert "matmul[einsum]" in text and "x stock" in text
