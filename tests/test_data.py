"""Datasets and loaders: CIFAR-100 from files in torchvision's real format, ImageFolder from
generated images, the embedded digits, clear errors for missing data, resumable sampling."""
import pytest
import torch

from conftest import FAST_TRAINER, TINY_MODELS
from mesa_train.train import data as data_lib
from mesa_train.train.runner import fit


def test_cifar100_from_generated_files(compose_train, cifar100_root, tmp_path):
    cfg = compose_train(["data=cifar100", f"data.root={cifar100_root}", "model.img_size=32", "optim=deit"])
    train = data_lib.build_dataset(cfg, train=True)
    val = data_lib.build_dataset(cfg, train=False)
    assert len(train) == 40 and len(val) == 20 and len(train.classes) == 100
    image, label = train[0]  # RandAugment + random erasing + normalisation on a PIL image
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and 0 <= label < 100
    # and a 2-step training run on it
    summary = fit(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + [
        "data=cifar100", f"data.root={cifar100_root}", "mesa.enabled=false"]), str(tmp_path / "run"))
    assert summary["step"] == 2 and summary["data"] == "cifar100"


def test_cifar100_md5_check_is_optional(compose_train, cifar100_root):
    cfg = compose_train(["data=cifar100", f"data.root={cifar100_root}", "data.verify_md5=true"])
    with pytest.raises(data_lib.DataError, match="could not read CIFAR-100"):
        data_lib.build_dataset(cfg, train=True)  # our generated files are not the real ones


def test_image_folder_from_generated_images(compose_train, imagefolder_root, tmp_path):
    cfg = compose_train(["data=imagenet", f"data.root={imagefolder_root}", "model.img_size=32",
                         "trainer.num_workers=0"])
    loaders = data_lib.build_loaders(cfg, train=False)
    assert loaders.num_classes == 3 and len(loaders.val.dataset) == 9
    images, labels = next(iter(loaders.val))
    assert images.shape[1:] == (3, 32, 32) and set(labels.tolist()) <= {0, 1, 2}
    summary = fit(compose_train(TINY_MODELS["deit"] + FAST_TRAINER + [
        "data=imagenet", f"data.root={imagefolder_root}", "mesa.enabled=false"]), str(tmp_path / "run"))
    assert summary["step"] == 2


def test_digits_split(compose_train):
    cfg = compose_train(["data=digits", "model.img_size=16"])
    train, val = data_lib.build_dataset(cfg, True), data_lib.build_dataset(cfg, False)
    assert (len(train), len(val)) == (1437, 360)
    image, label = val[0]
    assert image.shape == (3, 16, 16) and 0 <= label < 10


@pytest.mark.parametrize("name,needle", [
    ("cifar100", r"cifar-100-python/\{train,test,meta\}.*data.download=true"),
    ("imagenet", r"data.root='.*nothing' not found: .*nothing is not a directory"
                 r".*train/<class>/<image>.*image-net.org"),
])
def test_missing_data_says_layout_and_how_to_get_it(compose_train, tmp_path, name, needle):
    cfg = compose_train([f"data={name}", f"data.root={tmp_path / 'nothing'}"])
    with pytest.raises(data_lib.DataError, match=f"(?s){needle}"):
        data_lib.build_loaders(cfg)


def test_cifar100_never_downloads_unless_asked(compose_train, tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR100

    monkeypatch.setattr(CIFAR100, "download", lambda self: pytest.fail("tried to download"))
    cfg = compose_train(["data=cifar100", f"data.root={tmp_path}"])
    with pytest.raises(data_lib.DataError):
        data_lib.build_dataset(cfg, train=True)


def test_sampler_resumes_mid_epoch_and_shards():
    dataset = list(range(20))
    full = list(data_lib.ResumableSampler(dataset, 1, 0, seed=3))
    sampler = data_lib.ResumableSampler(dataset, 1, 0, seed=3)
    sampler.set_epoch(0, start=8)
    assert list(sampler) == full[8:] and len(sampler) == 12
    sampler.set_epoch(1)
    assert [i for i, _ in sampler] != [i for i, _ in full] and {e for _, e in sampler} == {1}
    shards = [list(data_lib.ResumableSampler(dataset, 2, r, seed=3)) for r in (0, 1)]
    assert sorted(i for s in shards for i, _ in s) == sorted(dataset)
    assert list(data_lib.ShardSampler(5, 1, 2)) == [1, 3]


def test_augmentation_depends_only_on_seed_epoch_index(compose_train):
    cfg = compose_train(["data=digits", "model.img_size=16", "optim=deit"])
    ds = data_lib.SeededDataset(data_lib.build_dataset(cfg, True), seed=0)
    state = torch.get_rng_state()
    a, b = ds[(5, 0)][0], ds[(5, 0)][0]
    assert torch.equal(a, b) and not torch.equal(a, ds[(5, 1)][0])
    assert torch.equal(state, torch.get_rng_state())  # loading never moves the training RNG


def test_batches_do_not_depend_on_workers(compose_train):
    def batches(workers, start=0):
        cfg = compose_train(["data=digits", "model.img_size=16", "optim=deit", "data.train_size=24",
                             "trainer.batch_size=4", f"trainer.num_workers={workers}"])
        loader = data_lib.build_loaders(cfg).train
        loader.sampler.set_epoch(2, start=start)
        return [x for x, _ in loader]

    serial, parallel = batches(0), batches(2)
    assert len(serial) == 6 and all(torch.equal(a, b) for a, b in zip(serial, parallel))
    assert all(torch.equal(a, b) for a, b in zip(serial[3:], batches(2, start=12)))  # mid-epoch start
