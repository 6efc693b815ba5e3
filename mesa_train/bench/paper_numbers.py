"""Numbers from the Mesa paper (Pan et al., "Mesa: A Memory-saving Training Framework for
Transformers"), copied from the paper text (`/work/shared/reference/mesa_paper.txt`), so
the benchmark can print them beside ours.

Keys are ``"<table>/<row>"`` with the row written as in the paper. Memory is the paper's
"Train Memory (MB)" (``torch.cuda.max_memory_allocated``), throughput its "Train
Throughput (images/s)". Hardware: Table 1 on a V100 (ImageNet), the ablations (Tables 7,
8, 12, 13, 14) on an RTX 3090 per section 5.2; Table 9 on a 32 GB V100. All AMP (fp16).
"""
from __future__ import annotations

from dataclasses import dataclass

TABLES = {
    "table1": "Table 1: ImageNet, AMP, batch 128, 224x224, V100 (memory only; the paper "
    "gives GPU hours, not throughput)",
    "table7": "Table 7: DeiT-Ti on CIFAR-100, compressing one op type (batch 128, 224x224, RTX 3090)",
    "table8": "Table 8: DeiT-Ti on CIFAR-100, compressing one module (batch 128, 224x224, RTX 3090)",
    "table9": "Table 9: largest DeiT-B before out-of-memory, batch 128, one 32 GB V100",
    "table12": "Table 12: ActNN (L3, 2-bit) vs Mesa on DeiT-Ti, CIFAR-100",
    "table13": "Table 13: Swin-B/L on CIFAR-100, batch 64",
    "table14": "Table 14: Swin-Ti with checkpointing (CP) and gradient accumulation (GA)",
}


@dataclass(frozen=True)
class PaperRow:
    table: str
    row: str
    memory_mb: float | None = None
    throughput: float | None = None  # images/s
    top1: float | None = None
    batch_size: int | None = None
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.table}/{self.row}"

    @property
    def source(self) -> str:
        return f"{self.table.replace('table', 'Table ')}, row '{self.row}'"


_ROWS = [
    # Table 1 (ImageNet top-1; train memory MB at batch 128). PVT-Ti is approximated by
    # timm's pvt_v2_b1 (same size) because timm has no PVT v1.
    PaperRow("table1", "DeiT-Ti", 4171, None, 71.9, 128),
    PaperRow("table1", "DeiT-Ti w/ Mesa", 1858, None, 72.1, 128),
    PaperRow("table1", "DeiT-S", 8459, None, 79.8, 128),
    PaperRow("table1", "DeiT-S w/ Mesa", 3840, None, 80.0, 128),
    PaperRow("table1", "DeiT-B", 17691, None, 81.8, 128),
    PaperRow("table1", "DeiT-B w/ Mesa", 8616, None, 81.8, 128),
    PaperRow("table1", "Swin-Ti", 11812, None, 81.3, 128),
    PaperRow("table1", "Swin-Ti w/ Mesa", 5371, None, 81.3, 128),
    PaperRow("table1", "PVT-Ti", 7800, None, 75.1, 128, "PVT v1; we run pvt_v2_b1"),
    PaperRow("table1", "PVT-Ti w/ Mesa", 3782, None, 74.9, 128, "PVT v1; we run pvt_v2_b1"),
    # Table 7 (op types). "MatMul" covers all matrix multiplications (Linear layers and
    # the two attention products): the four single-op savings add up to "All".
    PaperRow("table7", "DeiT-Ti", 4149, 1196, 64.8, 128),
    PaperRow("table7", "+ Mesa w/ MatMul", 3505, 729, 65.3, 128),
    PaperRow("table7", "+ Mesa w/ GELU", 3540, 1031, 64.9, 128),
    PaperRow("table7", "+ Mesa w/ LayerNorm", 3844, 1059, 64.4, 128),
    PaperRow("table7", "+ Mesa w/ Softmax", 3485, 998, 64.8, 128),
    PaperRow("table7", "+ Mesa w/ All", 1855, 586, 65.2, 128),
    # Table 8 (modules, all ops)
    PaperRow("table8", "DeiT-Ti", 4149, 1196, 64.8, 128),
    PaperRow("table8", "+ Mesa w/ MSA", 3037, 772, 65.0, 128),
    PaperRow("table8", "+ Mesa w/ FFN", 3294, 888, 64.8, 128),
    PaperRow("table8", "+ Mesa w/ MSA + FFN", 1856, 597, 64.9, 128),
    # Table 12 (ActNN comparison)
    PaperRow("table12", "DeiT-Ti", 4149, 1196, 64.8, 128),
    PaperRow("table12", "+ ActNN", 3514, 635, 64.9, 128, "ActNN L3, 2-bit; not run here"),
    PaperRow("table12", "+ Mesa", 1855, 586, 65.2, 128),
    # Table 13 (batch 64; Swin-L trained 90 epochs, Swin-B 300)
    PaperRow("table13", "Swin-B", 13717, 111, 78.0, 64),
    PaperRow("table13", "Swin-B w/ Mesa all", 6708, 55, 78.0, 64),
    PaperRow("table13", "Swin-B w/ Mesa G+S", 9714, 97, 78.4, 64),
    PaperRow("table13", "Swin-L", 21851, 83, 64.5, 64),
    PaperRow("table13", "Swin-L w/ Mesa all", 11708, 38, 64.6, 64),
    PaperRow("table13", "Swin-L w/ Mesa G+S+LN", 13943, 67, 65.0, 64),
    # Table 14 (Swin-Ti; the GA rows list batch size 64: micro-batches of 64)
    PaperRow("table14", "Swin-Ti", 11812, 356, None, 128),
    PaperRow("table14", "w/ Mesa", 6741, 276, None, 128),
    PaperRow("table14", "w/ CP", 6885, 303, None, 128),
    PaperRow("table14", "w/ Mesa + CP", 4353, 244, None, 128),
    PaperRow("table14", "w/ GA", 6209, 333, None, 64),
    PaperRow("table14", "w/ Mesa + GA", 3682, 257, None, 64),
]

PAPER_ROWS: dict[str, PaperRow] = {r.key: r for r in _ROWS}

# Table 9: largest DeiT-B (batch 128) before OOM on a 32 GB V100.
# dim -> (DeiT-B, DeiT-B w/ Mesa, ratio as printed)
TABLE9 = {
    "depth": (12, 40, 3.3),
    "width": (12, 26, 2.2),
    "resolution": (224, 336, 1.5),
}


def paper_row(key: str | None) -> PaperRow | None:
    """Look up ``"<table>/<row>"``; None for None. Unknown keys are an error (typos in
    presets must not silently drop the paper column)."""
    if key is None:
        return None
    if key not in PAPER_ROWS:
        raise KeyError(f"unknown paper row {key!r}; valid keys: {', '.join(PAPER_ROWS)}")
    return PAPER_ROWS[key]
