"""mesa_train.inductor_backports: Inductor's persistent-reduction decision given the kernel's
tiling scores on a torch that lacks it (2.11, the lent GPUs' image), and nothing on one that has
it (2.14, this project's pin). What it changes in the generated code is checked by
``tests/test_inductor_gpu_code.py::test_census_of_a_stock_block`` (the softmax, one persistent
reduction), which fails on torch 2.11 with ``MESA_INDUCTOR_BACKPORTS=0``."""
from __future__ import annotations

from torch._inductor.codegen.triton import TritonKernel

from mesa_train import inductor_backports


class _Features:
    """Stands for SIMDKernelFeatures: its hint says which scores it was given."""

    reduction_numel = 197

    def get_reduction_hint(self, tiling_scores=None):
        return ("hint from", tiling_scores)


def test_the_decision_reads_the_kernel_scores():
    scores = {"x": 1, "r0_": 64}
    features = inductor_backports._FeaturesWithScores(_Features(), scores)
    assert features.get_reduction_hint() == ("hint from", scores)  # (what 2.11's decision asks)
    assert features.get_reduction_hint({"r0_": 2}) == ("hint from", {"r0_": 2})  # given ones are kept
    assert features.reduction_numel == 197  # everything else is the features' own


def test_installed_only_where_torch_lacks_the_fix(monkeypatch):
    before = TritonKernel.should_use_persistent_reduction
    needed = inductor_backports.persistent_decision_needs_scores()
    if not needed:  # torch 2.14 and later: nothing to do, nothing touched
        monkeypatch.setattr(inductor_backports, "_installed", False)
        assert inductor_backports.install() is False
        assert TritonKernel.should_use_persistent_reduction is before
    else:
        monkeypatch.setattr(TritonKernel, "should_use_persistent_reduction", before)
        monkeypatch.setattr(inductor_backports, "_installed", False)
        assert inductor_backports.install() is True
        assert TritonKernel.should_use_persistent_reduction is not before


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(inductor_backports, "_installed", False)
    monkeypatch.setenv(inductor_backports.ENV_SWITCH, "0")
    before = TritonKernel.should_use_persistent_reduction
    assert inductor_backports.install() is False
    assert TritonKernel.should_use_persistent_reduction is before


def test_status_says_what_a_report_needs(monkeypatch):
    """The bench's ``Versions`` line names the backport where the torch needs it (on, or off by the
    switch), and says nothing where the torch has the fix."""
    import torch

    from mesa_train.bench.report import environment

    real = inductor_backports.persistent_decision_needs_scores()
    assert inductor_backports.status() == ("on" if real else "not needed")
    assert environment(torch.device("cpu"))["inductor_backports"] == inductor_backports.status()
    monkeypatch.setattr(inductor_backports, "persistent_decision_needs_scores", lambda: True)
    assert inductor_backports.status() == "on"
    monkeypatch.setenv(inductor_backports.ENV_SWITCH, "0")
    assert inductor_backports.status() == f"off ({inductor_backports.ENV_SWITCH}=0)"
    monkeypatch.setattr(inductor_backports, "persistent_decision_needs_scores", lambda: False)
    assert inductor_backports.status() == "not needed"
