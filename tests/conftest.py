"""Shared test fixtures (generic: configs, tiny models, generated datasets, CLI runs).

Tests run on CPU. Anything that trains uses tiny models (``TINY_MODELS``) and a couple
of steps (``FAST_TRAINER``); subprocess runs get ``OMP_NUM_THREADS=1`` and wandb disabled.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"

os.environ.setdefault("WANDB_MODE", "disabled")  # never talk to wandb from tests

# Tiny variants of each model family (overrides of the `model` group).
TINY_MODELS = {
    "deit": ["model=deit_ti", "model.img_size=32", "model.depth=2", "model.embed_dim=32",
             "model.num_heads=2", "+model.kwargs.patch_size=8"],
    "swin": ["model=swin_ti", "model.img_size=32", "model.embed_dim=16", "+model.kwargs.patch_size=4",
             "+model.kwargs.depths=[1,1]", "+model.kwargs.num_heads=[1,2]", "+model.kwargs.window_size=4"],
    "pvt": ["model=pvt_v2_b0", "model.img_size=32", "+model.kwargs.depths=[1,1,1,1]",
            "+model.kwargs.embed_dims=[8,16,16,16]", "+model.kwargs.num_heads=[1,1,1,1]"],
}
# Two steps on CPU, no workers, no progress bar, synthetic data by default.
FAST_TRAINER = ["trainer.max_steps=2", "trainer.batch_size=4", "trainer.num_workers=0",
                "trainer.device=cpu", "trainer.amp=none", "trainer.progress=false", "trainer.log_every=1",
                "data.train_size=16", "data.val_size=8"]


@pytest.fixture
def compose_train():
    """``compose_train(overrides, config_name="train")`` -> the composed Hydra config."""
    from hydra import compose, initialize_config_dir

    def _compose(overrides=(), config_name="train", return_hydra_config=False):
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            return compose(config_name, overrides=list(overrides), return_hydra_config=return_hydra_config)

    return _compose


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="disabled",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.pop("MESA_RUN_STAMP", None)
    env.update(extra)
    return env


@pytest.fixture
def run_cli():
    """``run_cli([script, *args], cwd=None, timeout=180)`` -> CompletedProcess (text)."""

    def _run(args, cwd=None, timeout=180, **env):
        return subprocess.run([str(a) for a in args], cwd=cwd or REPO, env=cli_env(**env),
                              capture_output=True, text=True, timeout=timeout)

    return _run


def write_cifar100(root: Path, n_train: int = 40, n_test: int = 20, seed: int = 0) -> Path:
    """Small CIFAR-100 files in torchvision's real format: root/cifar-100-python/{train,test,meta}
    (pickled dicts, uint8 rows of 3072 = 3x32x32 channel-major pixels)."""
    rng = np.random.default_rng(seed)
    base = root / "cifar-100-python"
    base.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("test", n_test)):
        entry = {
            "data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
            "fine_labels": rng.integers(0, 100, size=n).tolist(),
            "coarse_labels": rng.integers(0, 20, size=n).tolist(),
            "filenames": [f"img_{i}.png" for i in range(n)],
            "batch_label": f"{name} batch",
        }
        with open(base / name, "wb") as f:
            pickle.dump(entry, f)
    with open(base / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"class_{i}" for i in range(100)],
                     "coarse_label_names": [f"super_{i}" for i in range(20)]}, f)
    return root


def write_image_folder(root: Path, classes=("cat", "dog", "fish"), per_class=(6, 3), size=20, seed=0) -> Path:
    """root/{train,val}/<class>/<n>.png and .jpg images (random pixels)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, count in zip(("train", "val"), per_class):
        for c in classes:
            folder = root / split / c
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 256, size=(size, size + i, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.{'png' if i % 2 else 'jpg'}")
    return root


@pytest.fixture
def cifar100_root(tmp_path) -> Path:
    return write_cifar100(tmp_path / "cifar")


@pytest.fixture
def imagefolder_root(tmp_path) -> Path:
    return write_image_folder(tmp_path / "imagenet")


def load_script(name: str):
    """``scripts/<name>.py`` as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # registered under its name, as an import would: Dynamo (torch 2.11) re-imports the module of
    # a function it traces by that name to read its globals, and failed on an unregistered one
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def python() -> str:
    """The interpreter running the tests (the project's venv)."""
    return sys.executable


@pytest.fixture
def aot_eager_compile(monkeypatch):
    """torch.compile with backend aot_eager for one test (traced through AOTAutograd as Inductor
    would trace it, without minutes of code generation); the list it returns collects each
    call's keyword arguments (scope, fullgraph, mode...)."""
    import functools

    import torch

    calls = []
    real_compile = torch.compile

    def traced_compile(fn, **kwargs):
        calls.append(kwargs)
        return real_compile(fn, **{**kwargs, "backend": "aot_eager"})

    monkeypatch.setattr(torch, "compile", functools.wraps(real_compile)(traced_compile))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return calls

