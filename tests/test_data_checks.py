"""Datasets are checked before training (issue 11): ImageFolder class lists, label range,
unreadable files named (or skipped), corrupt CIFAR pickles named, an offline download
explained, loader workers capped by the CPU cores."""
import pickle

import pytest

from conftest import FAST_TRAINER, TINY_MODELS, write_image_folder
from mesa_train.train import data as data_lib
from mesa_train.train.runner import fit


def test_val_split_lacking_a_class_is_refused(compose_train, tmp_path):
    root = write_image_folder(tmp_path / "imgs")
    for f in (root / "val" / "dog").iterdir():
        f.unlink()
    (root / "val" / "dog").rmdir()  # val/ has cat, fish: "fish" would become label 1
    cfg = compose_train(["data=imagenet", f"data.root={root}", "model.img_size=32", "trainer.num_workers=0"])
    with pytest.raises(data_lib.DataError, match="class folders of .*val differ from train/'s.*missing dog"):
        data_lib.build_loaders(cfg)


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_split_without_class_folders_is_refused(compose_train, tmp_path, split):
    """Images put straight into train/ or val/ (no class folders) were torchvision's traceback
    about 'class_to_index'; now the split and the layout are named."""
    root = write_image_folder(tmp_path / "imgs")
    for folder in (root / split).iterdir():
        for f in folder.iterdir():
            f.rename(root / split / f"{folder.name}-{f.name}")
        folder.rmdir()
    cfg = compose_train(["data=imagenet", f"data.root={root}", "model.img_size=32", "trainer.num_workers=0"])
    with pytest.raises(data_lib.DataError, match=f"(?s){root / split} has no class folders: .*train/<class>/<image>"):
        data_lib.build_loaders(cfg)


def test_val_labels_follow_train_classes(compose_train, tmp_path):
    root = write_image_folder(tmp_path / "imgs")
    cfg = compose_train(["data=imagenet", f"data.root={root}", "model.img_size=32"])
    val = data_lib.build_dataset(cfg, train=False)
    assert val.classes == ["cat", "dog", "fish"] and sorted(set(val.targets)) == [0, 1, 2]


def test_labels_out_of_range_are_refused(compose_train, cifar100_root):
    cfg = compose_train(["data=cifar100", f"data.root={cifar100_root}", "data.num_classes=10", "model.img_size=32",
                         "trainer.num_workers=0"])
    with pytest.raises(data_lib.DataError, match=r"training labels include .* outside \[0, 10\).*data.num_classes"):
        data_lib.build_loaders(cfg)


def test_corrupt_image_is_named_or_skipped(compose_train, tmp_path):
    root = write_image_folder(tmp_path / "imgs")
    bad = root / "val" / "dog" / "0.jpg"
    bad.write_bytes(b"not an image at all")
    base = ["data=imagenet", f"data.root={root}", "model.img_size=32", "trainer.num_workers=0",
            "trainer.batch_size=4"]
    loaders = data_lib.build_loaders(compose_train(base))
    with pytest.raises(data_lib.DataError, match=f"cannot read image {bad}.*data.skip_corrupt=true"):
        list(loaders.val)
    loaders = data_lib.build_loaders(compose_train(base + ["data.skip_corrupt=true"]))
    assert sum(len(y) for _, y in loaders.val) == 9  # the bad image replaced by the next one


def test_corrupt_image_in_a_worker_is_one_line(compose_train, tmp_path):
    from mesa_train.train.errors import describe

    root = write_image_folder(tmp_path / "imgs")
    for image in (root / "train").rglob("*.*"):
        image.write_bytes(b"\x89PNG truncated")
    cfg = compose_train(TINY_MODELS["deit"] + FAST_TRAINER + ["data=imagenet", f"data.root={root}",
                                                              "trainer.num_workers=1", "mesa.enabled=false"])
    with pytest.raises(data_lib.DataError) as info:
        fit(cfg, str(tmp_path / "run"))
    code, message = describe(info.value)
    assert code == 2 and message.startswith(f"cannot read image {root / 'train'}") and "Traceback" not in message
    assert "DataLoader worker" not in message and message.count("\n") == 0


@pytest.mark.parametrize("content", [b"", b"garbage, not a pickle", b"\x80\x04\x95"])
def test_corrupt_cifar_pickle_is_named(compose_train, cifar100_root, content):
    target = cifar100_root / "cifar-100-python" / "train"
    target.write_bytes(content)
    cfg = compose_train(["data=cifar100", f"data.root={cifar100_root}"])
    with pytest.raises(data_lib.DataError, match=f"could not read CIFAR-100 file {target}.*corrupt or truncated"):
        data_lib.build_dataset(cfg, train=True)


def test_offline_download_is_explained(compose_train, tmp_path, monkeypatch):
    from urllib.error import URLError

    from torchvision.datasets import CIFAR100

    def offline(self):
        raise URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(CIFAR100, "download", offline)
    cfg = compose_train(["data=cifar100", f"data.root={tmp_path}", "data.download=true"])
    with pytest.raises(data_lib.DataError, match="could not download CIFAR-100.*offline.*untar it in"):
        data_lib.build_dataset(cfg, train=True)


def test_workers_are_capped_by_the_cores(monkeypatch):
    monkeypatch.setattr(data_lib, "usable_cpus", lambda: 2)
    assert data_lib.worker_count(8) == 2
    assert data_lib.worker_count(8, world_size=2) == 0  # one core per process: load in the main process
    assert data_lib.worker_count(0) == 0
    monkeypatch.setattr(data_lib, "usable_cpus", lambda: 64)
    assert data_lib.worker_count(8, world_size=4) == 8


def test_cifar_pickle_helper_finds_the_bad_file(tmp_path):
    good = tmp_path / "meta"
    good.write_bytes(pickle.dumps({"a": 1}))
    (tmp_path / "train").write_bytes(b"junk")
    assert data_lib._first_unreadable_pickle(str(tmp_path), ("meta", "train")) == str(tmp_path / "train")
