"""Datasets, transforms and loaders for training and evaluation.

Four sources (``data.name``): ``cifar100`` (torchvision's python-pickle format),
``imagenet`` (ImageFolder ``train/`` and ``val/``), ``digits`` (scikit-learn's embedded
8x8 digits, offline) and ``synthetic`` (random tensors). Transforms come from timm's
``create_transform`` (RandAugment, random erasing, ...), mixup/cutmix from timm's ``Mixup``.

Reproducibility: the training sampler yields ``(index, epoch)`` pairs and
``SeededDataset`` seeds python/numpy/torch from ``(seed, epoch, index)`` around each
sample's transform. A sample's augmentation therefore depends only on those three numbers,
not on the worker that loads it or on what was loaded before. Resuming in the middle of an
epoch just starts the sampler at the right position and sees exactly the same batches.
"""
from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass
from urllib.error import URLError

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset, get_worker_info


class DataError(FileNotFoundError):
    """Missing or malformed data; the message says the expected layout and how to get it."""


# --------------------------------------------------------------------------- datasets


class SyntheticDataset(Dataset):
    """Standard-normal images with uniform random labels, a pure function of the index."""

    def __init__(self, size: int, num_classes: int, img_size: int, seed: int = 0):
        self.size, self.num_classes, self.img_size, self.seed = size, num_classes, img_size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randn(3, self.img_size, self.img_size, generator=g)
        label = int(torch.randint(self.num_classes, (), generator=g))
        return image, label


class DigitsDataset(Dataset):
    """scikit-learn's 8x8 handwritten digits as RGB PIL images (values 0..16 -> 0..255)."""

    def __init__(self, train: bool, val_fraction: float = 0.2, split_seed: int = 0, transform=None):
        from PIL import Image
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x_train, x_val, y_train, y_val = train_test_split(
            x, y, test_size=val_fraction, random_state=split_seed, stratify=y
        )
        xs, ys = (x_train, y_train) if train else (x_val, y_val)
        pixels = np.clip(np.rint(xs * (255.0 / 16.0)), 0, 255).astype(np.uint8).reshape(-1, 8, 8)
        self.images = [Image.fromarray(p, mode="L").convert("RGB") for p in pixels]
        self.targets = [int(t) for t in ys]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[index]


CIFAR100_HELP = (
    "CIFAR-100 expects torchvision's layout: {root}/cifar-100-python/{{train,test,meta}} "
    "(the python version, https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz, untarred "
    "in data.root). Download it with data.download=true, or point data.root at the folder "
    "that holds cifar-100-python/."
)


def cifar100(root: str, train: bool, transform, download: bool, verify_md5: bool):
    """torchvision's CIFAR100. Its md5 checks are skipped unless ``verify_md5`` (files
    made by other tools, or small test files, load as long as the format is right)."""
    from torchvision.datasets import CIFAR100

    base = os.path.join(root, "cifar-100-python")
    names = ("train", "test", "meta")
    if not download and not all(os.path.isfile(os.path.join(base, n)) for n in names):
        missing = [n for n in names if not os.path.isfile(os.path.join(base, n))]
        raise DataError(
            f"CIFAR-100 not found: missing {', '.join(missing)} in {os.path.abspath(base)}.\n"
            + CIFAR100_HELP.format(root=root)
        )
    cls = CIFAR100
    if not verify_md5:
        cls = type(
            "CIFAR100NoMD5",
            (CIFAR100,),
            {
                "train_list": [[n, None] for n, _ in CIFAR100.train_list],
                "test_list": [[n, None] for n, _ in CIFAR100.test_list],
                "meta": {**CIFAR100.meta, "md5": None},
            },
        )
    try:
        return cls(root, train=train, transform=transform, download=download)
    except (URLError, ConnectionError, TimeoutError) as err:  # offline, DNS, proxy ...
        raise DataError(f"could not download CIFAR-100 ({getattr(err, 'reason', err)}): this machine seems "
                        f"to be offline. Download {CIFAR100.url} elsewhere and untar it in "
                        f"{os.path.abspath(root)}, then run without data.download") from None
    except Exception as err:  # truncated or garbage pickles: name the file
        bad = _first_unreadable_pickle(base, ("train" if train else "test", "meta")) or base
        raise DataError(f"could not read CIFAR-100 file {os.path.abspath(bad)}: {type(err).__name__}: {err}. "
                        "The file is corrupt or truncated; download it again.\n"
                        + CIFAR100_HELP.format(root=root)) from None


def _first_unreadable_pickle(base: str, names) -> str | None:
    """The first of ``names`` that does not unpickle into a dict (only called after a failure)."""
    import pickle

    for name in names:
        path = os.path.join(base, name)
        try:
            with open(path, "rb") as f:
                if not isinstance(pickle.load(f, encoding="latin1"), dict):
                    return path
        except Exception:
            return path
    return None


IMAGEFOLDER_HELP = (
    "ImageNet (or any ImageFolder data) expects {root}/train/<class>/<image> and "
    "{root}/val/<class>/<image>, the same class folders in both. Get ILSVRC2012 from "
    "https://image-net.org, untar the train archives per class and sort val/ into class "
    "folders (e.g. with the common valprep.sh), then set data.root."
)


# PIL's modes of more than 8 bits a channel: convert("RGB") clips their values at 255 (a 16-bit
# PNG became an almost white image, without a word)
_WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def _to_8_bit(image):
    """``image`` with a wide grey mode (16-bit PNGs, 32-bit integer or float TIFFs) scaled to 8
    bits: 16-bit ones by their depth (also mode ``I`` with values past 255, as PIL may open a
    16-bit PNG), 8-bit values in mode ``I`` as they are, floats in [0, 1] times 255, anything else
    by its own range; other modes as they are."""
    if image.mode not in _WIDE_MODES:
        return image
    import numpy as np
    from PIL import Image

    a = np.asarray(image).astype(np.float64)
    lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
    if image.mode.startswith("I;16") or (image.mode == "I" and lo >= 0 and 255 < hi <= 65535):
        a = a / 257.0  # (the 16-bit depth: 0..65535 -> 0..255)
    elif image.mode == "F" and lo >= 0 and hi <= 1:
        a = a * 255.0
    elif not (image.mode == "I" and lo >= 0 and hi <= 255):  # (8-bit values in an I image: as they are)
        a = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(a)
    return Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), mode="L")


class _NamedImageLoader:
    """ImageFolder's image reader: an unreadable file becomes a ``DataError`` naming it, or,
    with ``skip``, ``None`` (``SkippingImageFolder`` then takes the next readable image)."""

    def __init__(self, skip: bool):
        self.skip = skip

    def __call__(self, path: str):
        from PIL import Image

        try:
            with open(path, "rb") as f:
                image = Image.open(f)
                return _to_8_bit(image).convert("RGB")
        except Exception as err:  # truncated, not an image, unreadable ...
            if self.skip:
                import logging

                logging.getLogger("mesa_train.train").warning("skipping unreadable image %s (%s)", path, err)
                return None
            raise DataError(f"cannot read image {path}: {type(err).__name__}: {err}. Remove or replace it, "
                            "or skip unreadable images with data.skip_corrupt=true") from None


def _image_folder_class(classes: list[str] | None):
    from torchvision.datasets import ImageFolder

    class SkippingImageFolder(ImageFolder):
        """ImageFolder that can take its class list from another split (val/ labelled as
        train/), and replaces a skipped image by the next readable one (same label
        distribution in expectation; deterministic per index)."""

        def find_classes(self, directory):
            if classes is None:
                return super().find_classes(directory)
            return list(classes), {c: i for i, c in enumerate(classes)}

        def __getitem__(self, index: int):
            for offset in range(len(self.samples)):
                path, target = self.samples[(index + offset) % len(self.samples)]
                sample = self.loader(path)
                if sample is not None:
                    break
            else:
                raise DataError(f"no readable image in {self.root}")
            if self.transform is not None:
                sample = self.transform(sample)
            if self.target_transform is not None:
                target = self.target_transform(target)
            return sample, target

    return SkippingImageFolder


def _folder_classes(path: str) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir())


def image_folder(root: str, split: str, transform, skip_corrupt: bool = False):
    """``root/split`` as an ImageFolder. Its class folders must be the training split's:
    labels are indices into train/'s sorted class list, so a val/ lacking a class would
    shift every later label."""
    path = os.path.join(root, split)
    if not os.path.isdir(root):  # (the root itself first: a mistyped data.root names itself)
        raise DataError(f"data.root={root!r} not found: {os.path.abspath(root)} is not a directory.\n"
                        + IMAGEFOLDER_HELP.format(root=root))
    if not os.path.isdir(path):
        raise DataError(f"ImageFolder split not found: {os.path.abspath(path)} is not a directory.\n"
                        + IMAGEFOLDER_HELP.format(root=root))
    train_path = os.path.join(root, "train")
    for where in dict.fromkeys(p for p in (train_path, path) if os.path.isdir(p)):
        if not _folder_classes(where):  # (torchvision's ImageFolder: a ValueError about 'class_to_index')
            raise DataError(f"{os.path.abspath(where)} has no class folders: its images go in one folder per "
                            "class.\n" + IMAGEFOLDER_HELP.format(root=root))
    classes = None
    if split != "train" and os.path.isdir(train_path):
        classes = _folder_classes(train_path)
        own = _folder_classes(path)
        if own != classes:
            missing, extra = sorted(set(classes) - set(own)), sorted(set(own) - set(classes))
            raise DataError(
                f"the class folders of {os.path.abspath(path)} differ from train/'s ({len(own)} vs {len(classes)}): "
                + "; ".join(p for p in (f"missing {_few(missing)}" if missing else "",
                                        f"not in train/ {_few(extra)}" if extra else "") if p)
                + ". Labels are positions in train/'s class list, so both splits need the same folders"
            )
    try:
        return _image_folder_class(classes)(path, transform=transform, loader=_NamedImageLoader(skip_corrupt))
    except (FileNotFoundError, RuntimeError) as err:
        raise DataError(f"could not read images from {os.path.abspath(path)}: {err}\n"
                        + IMAGEFOLDER_HELP.format(root=root)) from err


def _few(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


# ------------------------------------------------------------------------- transforms


def _posterize(img, bits_to_keep, **__):
    """timm's posterize for any bit count: Pillow >= 11 rejects 0 bits, which timm's
    increasing-severity RandAugment ('inc1', the DeiT recipe) asks for at magnitude 10.
    0 bits keeps nothing (a black image, what older Pillow returned)."""
    from PIL import ImageOps

    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return img.point(lambda _: 0)
    return ImageOps.posterize(img, bits_to_keep)


def _fix_timm_posterize() -> None:
    from timm.data import auto_augment

    for name, fn in list(auto_augment.NAME_TO_OP.items()):
        if fn is auto_augment.posterize:
            auto_augment.NAME_TO_OP[name] = _posterize


def build_transform(cfg, is_training: bool):
    """timm's ``create_transform`` with the data group's crop/flip/normalisation and the
    optim group's augmentation (RandAugment, random erasing, interpolation). ``None``
    for synthetic data (already tensors)."""
    if cfg.data.name == "synthetic":
        return None
    from timm.data import create_transform

    d, o = cfg.data, cfg.optim
    if is_training and o.auto_augment:
        _fix_timm_posterize()
    kwargs = dict(
        input_size=(3, cfg.model.img_size, cfg.model.img_size),
        is_training=is_training,
        interpolation=o.interpolation,
        mean=tuple(d.mean),
        std=tuple(d.std),
        crop_pct=d.crop_pct,
    )
    if is_training:
        kwargs.update(
            scale=tuple(d.scale) if d.scale is not None else None,
            ratio=tuple(d.ratio) if d.ratio is not None else None,
            hflip=d.hflip,
            color_jitter=o.color_jitter,
            auto_augment=o.auto_augment,
            re_prob=o.re_prob,
            re_mode=o.re_mode,
            re_count=o.re_count,
        )
    return create_transform(**kwargs)


def build_dataset(cfg, train: bool):
    """The training (``train=True``) or validation dataset of ``cfg.data``."""
    d = cfg.data
    transform = build_transform(cfg, is_training=train)
    if d.name == "synthetic":
        size = d.train_size if train else d.val_size
        return SyntheticDataset(size, d.num_classes, cfg.model.img_size, seed=0 if train else 1)
    if d.name == "digits":
        dataset = DigitsDataset(train, d.val_fraction, d.split_seed, transform=transform)
    elif d.name == "cifar100":
        dataset = cifar100(d.root, train, transform, bool(d.download), bool(d.verify_md5))
    elif d.name == "imagenet":
        dataset = image_folder(d.root, "train" if train else "val", transform, bool(d.get("skip_corrupt", False)))
    else:
        raise DataError(f"unknown data.name={d.name!r}")
    return _limit(dataset, d.get("train_size" if train else "val_size"))


def _limit(dataset, size: int | None):
    """At most ``size`` images, evenly spaced over the dataset (so every class of a
    class-sorted ImageFolder stays in); ``classes`` is kept."""
    if size is None or size >= len(dataset):
        return dataset
    indices = np.linspace(0, len(dataset) - 1, num=int(size)).round().astype(int).tolist()
    subset = Subset(dataset, indices)
    subset.classes = getattr(dataset, "classes", None)
    return subset


def num_classes_of(cfg, dataset) -> int:
    """``data.num_classes``, or the class folders found (ImageFolder with null)."""
    if cfg.data.num_classes is not None:
        return int(cfg.data.num_classes)
    classes = getattr(dataset, "classes", None)
    if not classes:
        raise DataError("data.num_classes is null and the dataset lists no classes")
    return len(classes)


def _targets(dataset) -> list[int] | None:
    """Every label of ``dataset`` without loading an image (None when unknown)."""
    if isinstance(dataset, Subset):
        inner = _targets(dataset.dataset)
        return None if inner is None else [inner[i] for i in dataset.indices]
    for attr in ("targets", "labels"):
        values = getattr(dataset, attr, None)
        if values is not None:
            return [int(v) for v in values]
    return None


def check_labels(dataset, num_classes: int, split: str) -> None:
    """Every label in [0, num_classes): a label out of range would fail at the first
    batch (IndexError) or, worse, train a wrong head silently."""
    targets = _targets(dataset)
    if not targets:
        return
    bad = sorted({t for t in targets if not 0 <= t < num_classes})
    if bad:
        raise DataError(
            f"the {split} labels include {_few([str(b) for b in bad])}, outside [0, {num_classes}) "
            f"(data.num_classes={num_classes}); set data.num_classes to the real class count or fix the labels"
        )


# -------------------------------------------------------------- sampling and loading


def _mix_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed * 1_000_003 + epoch) * 1_000_033 + index) % (2**63 - 1)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed is ~100x slower


@contextlib.contextmanager
def _seeded_rng(seed: int | None):
    """Seed python, numpy and torch (CPU) for one sample (``None``: the caller seeds). In the main process
    (num_workers=0) their states are restored afterwards, so loading data never moves the
    training RNG; a loader worker's RNG serves nothing else and is just re-seeded (cheap)."""
    if get_worker_info() is not None:
        if seed is not None:
            _seed_all(seed)
        yield
        return
    py, nps, th = random.getstate(), np.random.get_state(), torch.get_rng_state()
    if seed is not None:
        _seed_all(seed)
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(nps)
        torch.set_rng_state(th)


class SeededDataset(Dataset):
    """Wraps a dataset; ``ds[(index, epoch)]`` runs the base transform under RNG seeded
    from ``(seed, epoch, index)``; ``ds[index]`` is the plain sample."""

    def __init__(self, base: Dataset, seed: int):
        self.base, self.seed = base, seed

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key):
        if isinstance(key, tuple):
            index, epoch = key
            with _seeded_rng(_mix_seed(self.seed, epoch, index)):
                return self.base[index]
        return self.base[key]

    def __getitems__(self, keys: list) -> list:
        """A whole batch (the DataLoader's batched fetch): the training RNG is saved and
        restored once per batch instead of once per sample."""
        if not keys or not isinstance(keys[0], tuple):
            return [self.base[k] for k in keys]
        with _seeded_rng(None):
            samples = []
            for index, epoch in keys:
                _seed_all(_mix_seed(self.seed, epoch, index))
                samples.append(self.base[index])
            return samples


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (shuffled with ``seed + epoch``, one shard per rank) that
    yields ``(index, epoch)`` and can start mid-epoch: ``set_epoch(epoch, start=k)``
    skips this rank's first ``k`` samples."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, shuffle: bool = True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:  # noqa: D102
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self):
        indices = list(super().__iter__())
        return iter([(i, self.epoch) for i in indices[self.start:]])

    def __len__(self) -> int:
        return self.num_samples - self.start


class ShardSampler(Sampler):
    """Evaluation: rank r takes indices r, r + W, r + 2W, ... (no padding, no repeats, so
    summed metrics over ranks are exact)."""

    def __init__(self, size: int, rank: int, num_replicas: int):
        self.indices = list(range(rank, size, num_replicas))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


@dataclass
class Loaders:
    train: DataLoader | None
    val: DataLoader
    num_classes: int
    train_batches: int  # full-epoch batches per rank (independent of a mid-epoch start)
    # the class names in label order (an ImageFolder's folders, a torchvision set's names), or
    # None: checkpoints keep them, and a resume or evaluation on other class folders is refused
    classes: list | None = None


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_count(requested: int, world_size: int = 1) -> int:
    """``trainer.num_workers`` capped by this process's share of the CPU cores (more
    workers than cores only adds contention; PyTorch warns about it)."""
    per_process = max(usable_cpus() // max(world_size, 1), 1)
    return min(int(requested), per_process if per_process > 1 else 0)


def _ignore_sigint(_worker_id: int) -> None:
    """Workers leave Ctrl-C to the main process, which stops at the next optimizer step
    and saves last.pt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _loader(dataset, batch_size, sampler, cfg, drop_last, seed, world_size=1):
    workers = worker_count(cfg.trainer.num_workers, world_size)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=bool(cfg.trainer.pin_memory) and torch.cuda.is_available(),
        drop_last=drop_last,
        persistent_workers=False,
        worker_init_fn=_ignore_sigint if workers > 0 else None,
        # Own generator: creating an iterator never draws from the global torch RNG.
        generator=torch.Generator().manual_seed(seed),
    )


def build_loaders(cfg, rank: int = 0, world_size: int = 1, train: bool = True) -> Loaders:
    """Training loader (shuffled, seeded, resumable, drops the last partial batch) and
    validation loader (sharded over ranks, in order). Labels are checked against the
    class count before anything trains."""
    val_set = build_dataset(cfg, train=False)
    seed = int(cfg.trainer.seed)
    train_loader, train_batches = None, 0
    if train:
        train_set = build_dataset(cfg, train=True)
        num_classes = num_classes_of(cfg, train_set)
        check_labels(train_set, num_classes, "training")
        sampler = ResumableSampler(train_set, world_size, rank, seed=seed, shuffle=True)
        bs = int(cfg.trainer.batch_size)
        train_batches = sampler.num_samples // bs
        if train_batches == 0:
            raise DataError(
                f"the training set has {len(train_set)} images, {sampler.num_samples} per rank: "
                f"fewer than trainer.batch_size={bs}; use a smaller batch"
            )
        train_loader = _loader(SeededDataset(train_set, seed), bs, sampler, cfg, True, seed, world_size)
    else:
        num_classes = num_classes_of(cfg, val_set)
    check_labels(val_set, num_classes, "validation")
    val_loader = _loader(
        val_set, int(cfg.trainer.batch_size), ShardSampler(len(val_set), rank, world_size), cfg, False, seed,
        world_size,
    )
    named = getattr(train_set if train else val_set, "classes", None)
    classes = [str(c) for c in named] if named else None
    return Loaders(train_loader, val_loader, num_classes, train_batches, classes)


def build_mixup(cfg, num_classes: int):
    """timm ``Mixup`` (mixup/cutmix with label smoothing) or None when both are off."""
    o = cfg.optim
    if not (o.mixup > 0 or o.cutmix > 0):
        return None
    from timm.data import Mixup

    return Mixup(
        mixup_alpha=o.mixup,
        cutmix_alpha=o.cutmix,
        prob=o.mixup_prob,
        switch_prob=o.mixup_switch_prob,
        mode=o.mixup_mode,
        label_smoothing=o.smoothing,
        num_classes=num_classes,
    )
