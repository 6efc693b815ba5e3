"""The paper's top-1 accuracies for its ablation tables (Tables 1-8), copied from the paper
text (`/work/shared/reference/mesa_paper.txt`), so the accuracy table can print them beside
ours. Only their *direction* is comparable with a small DeiT on digits: the paper trains
DeiT-Ti (and DeiT-S/B, Swin-Ti, PVT-Ti in Table 1) for 300 epochs on CIFAR-100 / ImageNet.

Keys are ``"<table>/<row>"`` with the row written as in the paper. ``None`` means the
paper gives no number; ``"failed"`` means the paper reports that training did not converge.
"""
from __future__ import annotations

from dataclasses import dataclass

PaperValue = float | str | None


@dataclass(frozen=True)
class PaperAccuracy:
    table: str
    row: str
    cifar100: PaperValue = None
    imagenet: PaperValue = None

    @property
    def key(self) -> str:
        return f"{self.table}/{self.row}"

    def text(self) -> str:
        """``"65.2 (C100)"``, ``"72.1 (IN)"`` or both, as shown in the side column."""
        parts = []
        for name, value in (("C100", self.cifar100), ("IN", self.imagenet)):
            if value is not None:
                parts.append(f"{value:.1f} ({name})" if isinstance(value, float) else f"{value} ({name})")
        return ", ".join(parts) or "–"


_ROWS = [
    # Table 1: ImageNet top-1, DeiT-Ti (the model our small DeiT stands in for).
    PaperAccuracy("table1", "DeiT-Ti", imagenet=71.9),
    PaperAccuracy("table1", "DeiT-Ti w/ Mesa", imagenet=72.1),
    # Table 2: per-sample statistics (PS) vs running estimates (RE), DeiT-Ti.
    PaperAccuracy("table2", "DeiT-Ti*", cifar100=64.8, imagenet=71.9),
    PaperAccuracy("table2", "+ Mesa w/ PS", cifar100=65.1, imagenet=71.9),
    PaperAccuracy("table2", "+ Mesa w/ RE", cifar100=65.2, imagenet=72.1),
    # Table 3: nearest (NR) vs stochastic rounding (SR); NR "failed" to converge on ImageNet.
    PaperAccuracy("table3", "DeiT-Ti", cifar100=64.8, imagenet=71.9),
    PaperAccuracy("table3", "+ Mesa w/ NR", cifar100=64.7, imagenet="failed"),
    PaperAccuracy("table3", "+ Mesa w/ SR", cifar100=65.2, imagenet=72.1),
    # Table 4: symmetric vs asymmetric quantization (CIFAR-100).
    PaperAccuracy("table4", "DeiT-Ti", cifar100=64.8),
    PaperAccuracy("table4", "+ Mesa w/ sym", cifar100=63.2),
    PaperAccuracy("table4", "+ Mesa w/ asym", cifar100=65.2),
    # Table 5: layer-wise vs head-wise quantization groups (CIFAR-100).
    PaperAccuracy("table5", "DeiT-Ti", cifar100=64.8),
    PaperAccuracy("table5", "+ Mesa w/ Layer", cifar100=64.7),
    PaperAccuracy("table5", "+ Mesa w/ Head", cifar100=65.2),
    # Table 6: decay lambda of the running estimates (CIFAR-100); 0.999 "failed".
    PaperAccuracy("table6", "DeiT-Ti", cifar100=64.8),
    PaperAccuracy("table6", "+ Mesa 0.0", cifar100=64.5),
    PaperAccuracy("table6", "+ Mesa 0.9", cifar100=65.2),
    PaperAccuracy("table6", "+ Mesa 0.99", cifar100=65.0),
    PaperAccuracy("table6", "+ Mesa 0.999", cifar100="failed"),
    # Table 7: one op type compressed (CIFAR-100); "MatMul" = every matrix multiplication.
    PaperAccuracy("table7", "DeiT-Ti", cifar100=64.8),
    PaperAccuracy("table7", "+ Mesa w/ MatMul", cifar100=65.3),
    PaperAccuracy("table7", "+ Mesa w/ GELU", cifar100=64.9),
    PaperAccuracy("table7", "+ Mesa w/ LayerNorm", cifar100=64.4),
    PaperAccuracy("table7", "+ Mesa w/ Softmax", cifar100=64.8),
    PaperAccuracy("table7", "+ Mesa w/ All", cifar100=65.2),
    # Table 8: one module compressed, every op in it (CIFAR-100).
    PaperAccuracy("table8", "DeiT-Ti", cifar100=64.8),
    PaperAccuracy("table8", "+ Mesa w/ MSA", cifar100=65.0),
    PaperAccuracy("table8", "+ Mesa w/ FFN", cifar100=64.8),
    PaperAccuracy("table8", "+ Mesa w/ MSA + FFN", cifar100=64.9),
]

PAPER_ACCURACY: dict[str, PaperAccuracy] = {r.key: r for r in _ROWS}

TABLE_TITLES = {
    "table1": "Table 1: Mesa vs stock (ImageNet)",
    "table2": "Table 2: per-sample statistics (PS) vs running estimates (RE)",
    "table3": "Table 3: nearest (NR) vs stochastic rounding (SR)",
    "table4": "Table 4: symmetric vs asymmetric quantization",
    "table5": "Table 5: layer-wise vs head-wise quantization groups",
    "table6": "Table 6: decay (lambda) of the running estimates",
    "table7": "Table 7: compressing one op type",
    "table8": "Table 8: compressing one module",
}


def paper_accuracy(key: str) -> PaperAccuracy:
    """Look up ``"<table>/<row>"``; an unknown key is an error naming the valid keys."""
    if key not in PAPER_ACCURACY:
        raise KeyError(f"unknown paper row {key!r}; valid keys: {', '.join(PAPER_ACCURACY)}")
    return PAPER_ACCURACY[key]
