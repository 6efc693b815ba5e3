"""Compiled autograd (``torch._dynamo.compiled_autograd``) through the eager Mesa layers.

``torch._dynamo.config.compiled_autograd = True`` (torchtitan's option) compiles the backward
of every step run inside a compiled function, and the parts of the forward that ran eagerly
(graph breaks) are eager layers. Inside compiled autograd's context those record their Python
Functions, whose backward compiled autograd traces into its graph; outside it (a forward run
plain, its backward compiled) they record their C++ layer ops' nodes, which compiled autograd
calls as opaque functions. Four of those nodes crashed the backward with a PyTorch internal
assert (``ctx_.non_differentiable_.empty()``: Linear, Softmax, Conv2d/Conv1d;
``dirty_inputs_``: the in-place ReLU / ReLU6 / Hardsigmoid, also on a view, where the node
sits inside the base's CopySlices), and the scale-branch link with "unhashable type:
'Capsule'". Each layer here runs its forward, then its backward under compiled autograd, and
must give the plain backward's gradients bit for bit. (The layers whose nodes never held those
marks pass on the code before too: a sweep that catches a mark or a capsule a node gains later.)
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from mesa_train.bench.overhead import _cases
from mesa_train.nn import conv as conv_mod
from mesa_train.patch import patch_model
from op_calls import count_calls

compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")

_LAYER_CASES = dict(_cases())
# the in-place activations (mesa::mask_train_, a node that marks its input dirty), as timm's
# ResNets and MobileNets build them
_IMAGE = lambda: (torch.randn(2, 2, 4, 4),)  # noqa: E731
_LAYER_CASES.update({
    "ReLU(inplace)": (lambda: nn.ReLU(inplace=True), lambda s: patch_model(nn.Sequential(s)), _IMAGE),
    "ReLU6(inplace)": (lambda: nn.ReLU6(inplace=True), lambda s: patch_model(nn.Sequential(s)), _IMAGE),
    "Hardsigmoid(inplace)": (lambda: nn.Hardsigmoid(inplace=True), lambda s: patch_model(nn.Sequential(s)), _IMAGE),
})


class _HalfReLU(nn.Module):
    """An in-place ReLU on a view, half the channels of a fresh tensor: its node sits inside
    the base's CopySlices node."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        y = x * 1
        self.act(y[:, :2])
        return y


# layers whose C++ node the autograd graph does not list (it sits inside another node)
_HIDDEN_NODE_CASES = {
    "ReLU(inplace) on a view": (_HalfReLU, patch_model, lambda: (torch.randn(2, 4, 4, 4),)),
}


def _compiled():
    return compiled_autograd._enable(torch.compile(backend="aot_eager"))


def _gradients(model: nn.Module, inputs, *, backward_in=None) -> list:
    """The inputs' and parameters' gradients of a weighted sum of ``model``'s output, the
    backward inside the context given (none: plain eager)."""
    torch.manual_seed(1)  # (the same rounding draws each run)
    model = copy.deepcopy(model)
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = model(*[x * 1 for x in xs])  # (a tensor computed with gradients, as in a model)
    loss = (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    with backward_in or contextlib.nullcontext():
        loss.backward()
    return [x.grad for x in xs] + [p.grad for p in model.parameters()]


def _assert_same(expected: list, got: list) -> None:
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a, b), f"gradient {i}: largest difference {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("name", sorted(_LAYER_CASES))
def test_a_step_run_under_compiled_autograd_gives_eager_gradients(name):
    """The step as ``torch.compile`` runs it with the flag set: the eager forward inside
    compiled autograd's context too, so every layer runs its Python Function (the scale
    branch its Python link), and the gradients are the plain step's on the C++ nodes."""
    make_stock, convert, inputs = _LAYER_CASES[name]
    torch.manual_seed(0)
    mesa = convert(make_stock()).train()
    xs = inputs()
    expected = _gradients(mesa, xs)
    with _compiled():
        got = _gradients(mesa, xs)
    _assert_same(expected, got)


def _cpp_layer_nodes(out: torch.Tensor) -> set:
    """The names of the C++ layer ops' nodes (``torch::autograd::CppNode<mesa::...>``) in the
    autograd graph behind ``out``."""
    names, seen, stack = set(), set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name().startswith("torch::autograd::CppNode<mesa::"):
            names.add(node.name())
        stack.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("name", sorted(_LAYER_CASES))
def test_inside_compiled_autograd_the_layers_record_their_python_functions(name):
    """Compiled autograd calls a C++ node as an opaque function, a graph break each (a resnet10t's
    first compiled step 12x slower than on the Python Functions, repvgg_a0's and mobileone_s0's
    past 400 s: results/compiled-autograd), and traces a Python Function's backward into its
    graph: inside its context every layer records its Python Function
    (``quantizer.fused_layers_on``), outside its C++ node."""
    make_stock, convert, inputs = _LAYER_CASES[name]
    torch.manual_seed(0)
    mesa = convert(make_stock()).train()
    xs = [x.requires_grad_() for x in inputs()]
    assert _cpp_layer_nodes(mesa(*[x * 1 for x in xs])), "no C++ layer node outside the context"
    with _compiled():
        inside = _cpp_layer_nodes(mesa(*[x * 1 for x in xs]))
    assert not inside


def test_inside_compiled_autograd_an_in_place_activation_on_a_view_runs_its_python_function(monkeypatch):
    """The case the graph walk cannot see (the node inside the base's CopySlices): the op is
    called outside the context, not inside it."""
    calls = count_calls(monkeypatch, "mask_train_")
    mesa = patch_model(_HalfReLU()).train()
    x = torch.randn(2, 4, 4, 4, requires_grad=True)
    mesa(x)
    assert len(calls) == 1
    with _compiled():
        mesa(x).sum().backward()
    assert len(calls) == 1 and torch.equal(x.grad[:, 2:], torch.ones_like(x.grad[:, 2:]))


@pytest.mark.parametrize("name", sorted(n for n in [*_LAYER_CASES, *_HIDDEN_NODE_CASES] if n != "ScaleBranch"))
def test_an_eager_forward_s_backward_compiles(name):
    """The forward run plain, its backward alone under compiled autograd: the C++ nodes made
    outside the context (the internal asserts fired here; for the in-place ReLU on a view,
    inside the base's CopySlices). The scale branch is the exception: its forward cannot
    know, and its C++ link stays one compiled autograd cannot key on."""
    make_stock, convert, inputs = {**_LAYER_CASES, **_HIDDEN_NODE_CASES}[name]
    torch.manual_seed(0)
    mesa = convert(make_stock()).train()
    xs = inputs()
    _assert_same(_gradients(mesa, xs), _gradients(mesa, xs, backward_in=_compiled()))


def test_the_scale_branch_takes_its_python_link_under_compiled_autograd():
    """What ``conv.Conv2d.forward`` asks before it takes the C++ link, for both ways the
    compiler gets switched on."""
    assert not conv_mod.compiled_autograd_may_run()
    with _compiled():
        assert conv_mod.compiled_autograd_may_run()
    with torch._dynamo.config.patch(compiled_autograd=True):
        assert conv_mod.compiled_autograd_may_run()


def test_a_convnet_trains_under_the_compiled_autograd_flag():
    """A ResNet stem (conv, BatchNorm, in-place ReLU, max pool) and a scale branch (a 1x1
    depthwise conv into a BatchNorm, linked), stepped by a compiled function that runs the
    model eagerly (``torch.compiler.disable``, as a graph break would: the C++ layer ops),
    with ``torch._dynamo.config.compiled_autograd`` set: the backward is compiled (one
    capture) and the gradients are eager's."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = patch_model(nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
        nn.Sequential(nn.Conv2d(4, 4, 1, groups=4, bias=False), nn.BatchNorm2d(4)), nn.ReLU(inplace=True),
        nn.Flatten(), nn.Linear(64, 4))).train()
    x = torch.randn(2, 3, 8, 8)

    def step(m):
        loss = (torch.compiler.disable(m)(x) * torch.linspace(-1, 1, 8).view(2, 4)).sum()
        loss.backward()

    expected_model = copy.deepcopy(model)
    torch.manual_seed(1)
    step(expected_model)
    counters.clear()
    torch.manual_seed(1)
    with torch._dynamo.config.patch(compiled_autograd=True):
        torch.compile(step, backend="aot_eager")(model)
    assert counters["compiled_autograd"]["captures"] == 1
    for (name, p), q in zip(model.named_parameters(), expected_model.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("forward_inside", [False, True], ids=["cpp-node", "python-function"])
@pytest.mark.parametrize("op,act,layer", [("linear", nn.Tanh, "Linear"),
                                          ("softmax", lambda: nn.Softmax(-1), "Softmax")])
def test_a_penalty_under_compiled_autograd_is_refused(op, act, layer, forward_inside):
    """A gradient penalty through a Mesa layer under compiled autograd must stop with the one
    line (the backward checks grad mode there too), not come back wrong: through the C++ node
    (a forward run outside the context) and through the Python Function (one run inside)."""
    torch.manual_seed(0)
    mesa = patch_model(nn.Sequential(nn.Linear(8, 16), act(), nn.Linear(16, 4)), ops=[op]).train()
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=f"higher-order gradients .* through a Mesa {layer} "):
        with _compiled() if forward_inside else contextlib.nullcontext():
            y = mesa(x * 1)
        with _compiled():
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            g.pow(2).sum().backward()
