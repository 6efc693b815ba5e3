"""Human-readable device names for result files (benchmarks name the hardware they ran on)."""
from __future__ import annotations

import platform

import torch


def device_name(device: torch.device) -> str:
    """``NVIDIA H100 80GB HBM3`` on CUDA; ``CPU (<model>, <n> threads)`` on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU ({model or platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
