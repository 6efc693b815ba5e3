"""Measure one training configuration: peak memory and throughput of a full training step
(forward, backward, optimizer step) after warm-up.

Order for each row, all in this process:

1. build the model (timm), switch attention kind, patch it with Mesa, turn on gradient
   checkpointing, move it to the device; AdamW (or SGD) over random images and labels;
2. ``warmup`` steps (the optimizer state exists afterwards, so the later peak includes it);
3. one forward under `mesa_train.memory.SavedTensorMeter`: the bytes saved for backward
   (device independent; one micro-batch when accumulating gradients);
4. one memory step: on CUDA ``reset_peak_memory_stats`` then ``max_memory_allocated``
   (what the paper reports: weights, gradients, optimizer state and activations; a
   CUDA-graph row resets before its warm-up instead, since its graph pool is allocated while
   the graph is recorded and a replay allocates nothing); on CPU
   the process's peak RSS during the step (``VmHWM`` after resetting it through
   ``/proc/self/clear_refs``), and that peak minus the RSS when the step started;
5. ``steps`` timed steps, synchronizing the device around each; images/s = batch size /
   the median step time (robust to other processes on a shared machine; the mean-based
   figure is kept as ``throughput_mean``).

Out-of-memory (CUDA OOM or a failed CPU allocation) is caught and reported as "oom".
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import math
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from mesa_train.bench.presets import BenchConfigError, RowConfig
from mesa_train.models import build_model, set_fused_attention
from mesa_train.nn.quantizer import mark_estimates_ready
from mesa_train.compile_scope import compile_model
from mesa_train.quant.compile_kernels import set_compile_kernels
from mesa_train.train.config import CUDA_GRAPH_COMPILE_MODES

MB = 1024 * 1024


class MesaUnavailable(RuntimeError):
    """A Mesa row was requested but `mesa_train.patch.patch_model` cannot be imported."""


@dataclass
class Measurement:
    status: str = "ok"  # ok | oom | error | skipped
    error: str = ""
    n_params: int | None = None
    saved_mb: float | None = None  # activation bytes saved for backward (one micro-batch)
    param_mb: float | None = None  # parameter bytes seen by the meter
    peak_mb: float | None = None  # CUDA max_memory_allocated / CPU peak RSS during the step
    peak_kind: str = ""
    step_rss_mb: float | None = None  # CPU: peak RSS during the step minus RSS at its start
    reserved_mb: float | None = None  # CUDA max_memory_reserved
    throughput: float | None = None  # images/s: batch / median step time
    throughput_mean: float | None = None  # images/s: all timed images / total time
    step_ms_mean: float | None = None
    step_ms_median: float | None = None
    # CUDA: median time for a timed step's Python to return, before the synchronize that ends
    # it (kernels launched, not run). Close to step_ms_median: the host is what the step waits
    # on (or CUDA's launch queue was full); well below it: the GPU is.
    host_ms_median: float | None = None
    timed_steps: int = 0
    graphs: int | None = None  # compiled rows: graphs Dynamo captured (1 = the whole step's forward)
    graph_breaks: int | None = None  # compiled rows: graph breaks Dynamo took
    compile_s: float | None = None  # compiled rows: the first warm-up step, compilation included
    final_loss: float | None = None
    wall_s: float | None = None  # the whole measurement, build included
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- devices

def resolve_device(name: str) -> torch.device:
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:  # (torch's own message lists two dozen device types)
        raise BenchConfigError(f"device={name!r} is not supported; valid choices: auto, cpu, cuda, cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BenchConfigError(f"device={name!r} requested but no CUDA device is visible; "
                               "valid choices here: auto, cpu")
    if dev.type not in ("cpu", "cuda"):
        raise BenchConfigError(f"device={name!r} is not supported; valid choices: auto, cpu, cuda, cuda:N")
    return dev


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CpuRss:
    """Per-step peak RSS on Linux, and the glibc malloc settings for memory and for speed.

    For the memory step glibc is told to serve every allocation above 128 KiB with mmap and
    to trim freed heap above 128 KiB (fixed thresholds, no dynamic growth), and freed heap is
    trimmed before it, so RSS follows the live tensors instead of what malloc keeps cached.
    Those settings make every large tensor a fresh mapping whose pages fault in on first
    touch: on the cpu-quick DeiT they made steps 1.4-1.7x slower, and Mesa (more, smaller
    tensors) slower than stock by more than it is. Timed steps therefore run with the
    thresholds glibc's own dynamic rule ends at in a training process (32 MiB mmap, 64 MiB
    trim: the 64-bit maximum, reached once a tensor that large has been freed), i.e. heap
    reuse as in an ordinary run (``for_speed``)."""

    _M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3

    def __init__(self) -> None:
        self.libc = None
        name = ctypes.util.find_library("c")
        try:
            self.libc = ctypes.CDLL(name) if name else None
        except OSError:
            self.libc = None
        self.for_memory()
        self.can_reset = os.path.exists("/proc/self/clear_refs")

    def _mallopt(self, mmap_bytes: int, trim_bytes: int) -> None:
        if self.libc is not None and hasattr(self.libc, "mallopt"):
            self.libc.mallopt(self._M_MMAP_THRESHOLD, mmap_bytes)
            self.libc.mallopt(self._M_TRIM_THRESHOLD, trim_bytes)

    def for_memory(self) -> None:
        """RSS follows the live tensors (the memory step)."""
        self._mallopt(128 * 1024, 128 * 1024)

    def for_speed(self) -> None:
        """Heap reuse as in an ordinary training process (timed steps)."""
        self._mallopt(32 * 1024 * 1024, 64 * 1024 * 1024)

    @staticmethod
    def _status_kb(key: str) -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    def trim(self) -> None:
        gc.collect()
        if self.libc is not None and hasattr(self.libc, "malloc_trim"):
            self.libc.malloc_trim(0)

    def reset_peak(self) -> bool:
        if not self.can_reset:
            return False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            return True
        except OSError:
            self.can_reset = False
            return False

    def current_mb(self) -> float | None:
        kb = self._status_kb("VmRSS")
        return None if kb is None else kb / 1024

    def peak_mb(self) -> float | None:
        kb = self._status_kb("VmHWM")
        if kb is None:
            import resource

            kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return kb / 1024


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    if isinstance(err, MemoryError):
        return True
    msg = str(err)
    # cuBLAS / cuDNN report a failed workspace allocation under a memory cap this way
    return isinstance(err, RuntimeError) and (
        "out of memory" in msg.lower() or "can't allocate memory" in msg
        or "ALLOC_FAILED" in msg or "NOT_ENOUGH_WORKSPACE" in msg)


# --------------------------------------------------------------------------- model

def mesa_patch_model():
    """`mesa_train.patch.patch_model`, or MesaUnavailable with the reason."""
    try:
        from mesa_train.patch import patch_model
    except Exception as err:  # ImportError, or the package failing to import
        raise MesaUnavailable(
            "Mesa rows need mesa_train.patch.patch_model, which cannot be imported here "
            f"({type(err).__name__}: {err}); run only the stock rows with only=<label>, or "
            "install the package with `make install`") from None
    return patch_model


def build_for_row(row: RowConfig, device: torch.device | str = "cpu", patch: bool = True):
    """The row's model: timm build with its overrides, attention kind, Mesa patch,
    gradient checkpointing; on ``device``. ``patch=False`` skips Mesa (validation)."""
    overrides = row.model_overrides()
    fused = row.attention == "fused"
    device = torch.device(device)
    # On a GPU, initialise the weights there (a CPU init of a 40-block DeiT-B takes seconds)
    with torch.device(device) if device.type == "cuda" else contextlib.nullcontext():
        try:  # (the row's img_size is optional for size-agnostic models: PVT-v2, CNNs)
            model = build_model(row.model, fused_attn=fused, img_size_optional="img_size" not in row.model_kwargs,
                                **overrides)
        except (ValueError, TypeError) as err:
            raise BenchConfigError(str(err)) from None
    n_attn = set_fused_attention(model, fused)
    if fused and n_attn == 0:
        raise BenchConfigError(f"model {row.model!r} has no timm attention module with a fused "
                               "(sdpa) path; valid attention choices for it: explicit")
    if row.mesa and patch:
        patch_model = mesa_patch_model()
        try:
            patch_model(model, ops=tuple(row.ops), modules=tuple(row.modules), **dict(row.quant))
        except ValueError as err:  # unknown op / module / option: the message lists choices
            raise BenchConfigError(f"patch_model: {err}") from None
        kinds = {bool(m.fused_attn) for m in model.modules() if hasattr(m, "fused_attn")}
        if kinds and kinds != {fused}:
            if fused:
                raise BenchConfigError(
                    f"mesa ops {list(row.ops)} switch the attention to the explicit path "
                    "(matmul and softmax exist only there; 'all' includes them), but the row "
                    "asks for attention=fused; for fused attention use ops: "
                    "[linear, gelu, layernorm, conv, relu, sdpa]")
            raise BenchConfigError(
                f"mesa ops {list(row.ops)} switch the attention to the fused (sdpa) path, but "
                "the row asks for attention=explicit; add matmul/softmax to the ops or set "
                "attention: fused")
    if row.grad_checkpointing:
        if not hasattr(model, "set_grad_checkpointing"):
            raise BenchConfigError(f"model {row.model!r} has no set_grad_checkpointing(); "
                                   "valid grad_checkpointing choices for it: false")
        try:
            model.set_grad_checkpointing(True)
        except (AssertionError, NotImplementedError) as err:
            raise BenchConfigError(f"model {row.model!r} cannot use gradient checkpointing: {err}") from None
    if device.type != "meta":
        model = model.to(device)
    if row.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if row.mesa and patch and device.type != "meta":
        # modules called more than once a forward: per-sample ranges from the first step, compiled
        # or not, as in training (mesa_train/patch/reuse.py; imported here, as patch_model is:
        # stock rows run where the package cannot be imported)
        from mesa_train.patch.reuse import probe_reuse

        probe_reuse(model, _row_images(row, 1, device, random=False))
        if row.duplicates == "skip":
            _skip_duplicates(row, model, device)
    model.train()
    return model


def _row_images(row: RowConfig, n: int, device: torch.device, *, random: bool) -> torch.Tensor:
    """``n`` start-up images in the row's size and memory format, as training makes them."""
    from mesa_train.patch.start_up import start_up_images

    return start_up_images(n, row.img_size, channels_last=row.channels_last, device=device, random=random)


def _skip_duplicates(row: RowConfig, model: torch.nn.Module, device: torch.device) -> None:
    """row.duplicates=skip: the Mesa layers whose every copy another module keeps in full anyway
    go stock, and attentions the ops moved off their fused path go back, where that lowers the
    bytes a training forward of two random images keeps under the row's amp: train.py's start-up
    (mesa.duplicates=skip, the same helper), so a row measures the model training runs. A failing
    forward leaves the row as patched, as training does, with a warning; out of memory stays the
    row's oom (mesa_train/patch/start_up.py). `skipped_duplicates_note` says what went."""
    from mesa_train.patch.start_up import skip_duplicated_at_start_up

    def run(m, images):
        with amp_context(row, device):
            return m(images)

    result = skip_duplicated_at_start_up(model, _row_images(row, 2, device, random=True), run=run)
    if result.failed:
        warnings.warn(f"row {row.label!r}: duplicates=skip {result.failed}", stacklevel=2)


def skipped_duplicates_note(row: RowConfig, model: torch.nn.Module) -> str:
    """What row.duplicates=skip left stock, kept in full or put back on the fused path ("" if nothing)."""
    if not (row.mesa and row.duplicates == "skip"):
        return ""
    from mesa_train.patch.start_up import skipped_note

    return skipped_note(model)


def make_optimizer(row: RowConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if row.optimizer == "sgd":  # (tensor ops only: capturable as it is)
        return torch.optim.SGD(params, lr=row.lr, momentum=0.9)
    # capturable: its step count stays on the device, where a CUDA graph's replay advances it
    return torch.optim.AdamW(params, lr=row.lr, weight_decay=0.05, capturable=row.cuda_graph)


def amp_context(row: RowConfig, device: torch.device):
    if row.amp == "fp32":
        return torch.autocast(device.type, enabled=False)
    dtype = torch.float16 if row.amp == "fp16" else torch.bfloat16
    # (a captured step cannot keep autocast's cast cache: its casts must run in every replay)
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False if row.cuda_graph else None)


class TrainStep:
    """forward + backward over ``accum_steps`` micro-batches, then one optimizer step."""

    def __init__(self, row: RowConfig, model, device: torch.device, seed: int = 0):
        self.row, self.model, self.device = row, model, device
        self.first_step_s: float | None = None  # set by warm_step (compilation included)
        # what runs forward: the compiled wrapper shares the model's parameters and buffers
        # (scope "blocks" compiles the model's blocks in place and runs the rest eager)
        # (Inductor's config: another backend, as the CPU tests' aot_eager, has none to take)
        options = {"options": dict(row.compile_options)} if row.compile_options and \
            row.compile_backend == "inductor" else {}
        self.forward_model = (compile_model(model, row.compile_scope, fullgraph=False, mode=row.compile_mode,
                                            backend=row.compile_backend, **options)
                              if row.compile else model)
        self.optimizer = make_optimizer(row, model)
        self.scaler = torch.amp.GradScaler(device.type) if row.amp == "fp16" else None
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(row.batch_size, 3, row.img_size, row.img_size, generator=gen)
        y = torch.randint(0, row.num_classes, (row.batch_size,), generator=gen)
        fmt = torch.channels_last if row.channels_last else torch.contiguous_format
        self.x, self.y = x.to(device, memory_format=fmt), y.to(device)
        self.last_loss: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None  # row.cuda_graph: the captured step (capture)

    def micro_batches(self):
        m = self.row.micro_batch
        for i in range(self.row.accum_steps):
            yield self.x[i * m:(i + 1) * m], self.y[i * m:(i + 1) * m]

    def forward_loss(self, x, y):
        # the row's compiled compression kernels (a global: rows run interleaved, each compiled
        # model keeps the code it was traced with, Dynamo guards on the choice)
        set_compile_kernels(self.row.compile_kernels)
        with amp_context(self.row, self.device):
            return F.cross_entropy(self.forward_model(x), y) / self.row.accum_steps

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()  # the whole step, launched by the GPU's own graph executor
            return
        if self.row.compile:
            # a training step's boundary for CUDA-graph trees (mode="reduce-overhead"): the
            # last step's graph outputs may be overwritten from here on (a no-op otherwise)
            torch.compiler.cudagraph_mark_step_begin()
        self.optimizer.zero_grad(set_to_none=True)
        self.accumulate_and_step()

    def capture(self) -> None:
        """row.cuda_graph: records one step (not run) in a CUDA graph that every later call
        replays. The gradients start from None, so the recorded backward writes them afresh
        (in the graph's memory) rather than adding to the last step's; the warm-up before it ran
        on a side stream, as torch.cuda.graph asks (cuBLAS workspaces, autograd's streams)."""
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.accumulate_and_step()
        self.graph = graph

    def accumulate_and_step(self) -> None:
        """forward + backward of every micro-batch (gradients added up), then the optimizer."""
        for x, y in self.micro_batches():
            loss = self.forward_loss(x, y)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
            self.last_loss = loss.detach()
            del loss
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()


def saved_bytes(step: TrainStep) -> tuple[float | None, float | None, str]:
    """(activation MB, parameter MB, note) of one micro-batch forward, via the meter."""
    try:
        from mesa_train.memory import SavedTensorMeter
    except Exception as err:  # not landed yet / broken: measure the rest anyway
        return None, None, f"saved bytes not measured: mesa_train.memory unavailable ({err})"
    x, y = next(step.micro_batches())
    with SavedTensorMeter(step.model) as meter:
        loss = step.forward_loss(x, y)
    # Backward releases the saved tensors. (Dropping the graph without one leaked it while the
    # meter's pack hook returned saved outputs with their grad_fn, a C++ reference cycle, and
    # measured RSS grew ~1 model per row; the hook now detaches them. The backward stays: the
    # step's gradients are the ones a training step leaves.)
    loss.backward()
    del loss
    step.optimizer.zero_grad(set_to_none=True)
    return meter.activation_bytes / MB, meter.parameter_bytes / MB, ""


# --------------------------------------------------------------------------- measure

def warm_step(row: RowConfig, device: torch.device, *, seed: int, fresh_cache: bool = True) -> TrainStep:
    """The row's model, optimizer and data after its ``warmup`` steps: the state every
    measurement (and the profile, `mesa_train.bench.profile`) starts from."""
    torch.manual_seed(seed)
    if row.compile and fresh_cache:
        torch._dynamo.reset()  # a fresh cache (and counters) per row: its graphs alone
        torch._dynamo.utils.counters.clear()
    step = TrainStep(row, build_for_row(row, device), device, seed=seed)
    # compiling is not timed; a captured step needs warm eager steps first (lazy state, the
    # estimates initialized, cuBLAS workspaces), on a side stream as torch.cuda.graph asks
    warm = max(row.warmup, 1 if row.compile else 3 if row.cuda_graph else 0)
    with _warm_stream(row, device):
        i = 0
        while i < warm:
            t0 = time.perf_counter()
            step()
            if i == 0:
                synchronize(device)
                step.first_step_s = time.perf_counter() - t0  # compiled rows: compilation included
                if row.compile and mark_estimates_ready(step.model):
                    # estimator=delayed: its traced one-pass form from now on, a rebuild in the next step
                    warm = max(warm, 2)
            i += 1
    if row.cuda_graph:
        step.capture()
    synchronize(device)
    return step


@contextlib.contextmanager
def _warm_stream(row: RowConfig, device: torch.device):
    """row.cuda_graph: the warm-up on a side stream, ordered after and before the current one."""
    if not row.cuda_graph:
        yield
        return
    if device.type != "cuda":
        raise BenchConfigError(f"row {row.label!r}: cuda_graph=true captures the step in a CUDA graph and needs a "
                               f"CUDA device (device={device}); run it on a GPU or leave the row out (skip=...)")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream(device).wait_stream(side)


def cuda_graph_peak(row: RowConfig, device: torch.device) -> bool:
    """Whether the row's peak must be read from before its warm-up: a CUDA-graph row on CUDA
    (a captured eager step, or torch.compile mode reduce-overhead / max-autotune)."""
    return device.type == "cuda" and (row.cuda_graph or (bool(row.compile)
                                                         and row.compile_mode in CUDA_GRAPH_COMPILE_MODES))


def dynamo_graphs() -> tuple[int, int]:
    """(graphs captured, graph breaks taken) since the last ``warm_step`` of a compiled row."""
    counters = torch._dynamo.utils.counters
    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def _measure(row: RowConfig, device: torch.device, *, seed: int, measure_saved: bool,
             timed: bool, rss: CpuRss | None) -> Measurement:
    result = Measurement()
    graphs = cuda_graph_peak(row, device)
    if graphs:
        # A CUDA graph's replay allocates nothing: its activations live in the graph pool,
        # taken while the graph is recorded during warm-up. The peak must span the recording
        # (a step after it saw only weights, gradients and optimizer state: 412 MB for a
        # DeiT-S step whose activations take GBs, results/speed/nvidia-h200.md before this).
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    step = warm_step(row, device, seed=seed)
    if row.compile:
        result.graphs, result.graph_breaks = dynamo_graphs()
        result.compile_s = step.first_step_s
    result.n_params = sum(p.numel() for p in step.model.parameters())
    skipped = skipped_duplicates_note(row, step.model)
    if skipped:
        result.notes.append(skipped)
    if row.warmup and not step.optimizer.state:
        result.notes.append("optimizer state not allocated after warm-up (GradScaler skipped "
                            "every step): the peak lacks it")

    if measure_saved and not row.compile:
        # (a compiled step's saved tensors are the partitioner's choice, outside autograd's
        # saved-tensor hooks: the peak is the measure there)
        result.saved_mb, result.param_mb, note = saved_bytes(step)
        if note:
            result.notes.append(note)

    _memory_step(step, device, result, graphs, rss)
    if timed:
        _timed_steps(step, row, device, result, rss)

    if step.last_loss is not None:
        loss = float(step.last_loss) * row.accum_steps
        result.final_loss = loss
        if not math.isfinite(loss):
            result.notes.append("non-finite loss")
    return result


def _memory_step(step, device: torch.device, result: Measurement, graphs: bool, rss: CpuRss | None) -> None:
    """One step's peak into ``result``: CUDA's max allocated (from the warm-up's recording
    with CUDA graphs), or the CPU process's peak RSS and the step's part of it."""
    if device.type == "cuda":
        synchronize(device)
        if not graphs:
            torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
        result.peak_mb = torch.cuda.max_memory_allocated(device) / MB
        result.reserved_mb = torch.cuda.max_memory_reserved(device) / MB
        result.peak_kind = "cuda_max_memory_allocated"
        if graphs:
            result.peak_kind += "_from_warmup"
            result.notes.append("peak over the warm-up (CUDA-graph recording) and one step: a "
                                "replay allocates nothing")
        return
    assert rss is not None
    rss.for_memory()
    rss.trim()
    exact = rss.reset_peak()
    start = rss.current_mb()
    step()
    result.peak_mb = rss.peak_mb()
    result.peak_kind = "cpu_peak_rss" if exact else "cpu_lifetime_peak_rss"
    if exact and start is not None and result.peak_mb is not None:
        result.step_rss_mb = max(result.peak_mb - start, 0.0)


def _timed_steps(step, row: RowConfig, device: torch.device, result: Measurement, rss: CpuRss | None) -> None:
    """``row.steps`` timed steps, synchronized around each: throughput from the median step,
    and on a GPU the median time a step's Python takes to return (host_ms_median)."""
    if rss is not None:
        rss.for_speed()
    times, host = [], []
    for _ in range(row.steps):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    # images/s from the median step: robust to other processes on a shared machine
    apply_step_times(row, result, times)
    if device.type == "cuda":  # (on the CPU a step returns when it is done: host == step)
        result.host_ms_median = 1000 * statistics.median(host)


def run_row(row: RowConfig, device: torch.device, *, seed: int = 0, measure_saved: bool = True,
            timed: bool = True) -> Measurement:
    """Measure one row. OOM -> status "oom"; MesaUnavailable and BenchConfigError
    propagate (the run cannot be meaningful); other failures -> status "error"."""
    rss = CpuRss() if device.type == "cpu" else None
    if rss is not None:
        rss.trim()
    started = time.perf_counter()
    result: Measurement
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.utils.checkpoint.*")
            result = _measure(row, device, seed=seed, measure_saved=measure_saved,
                              timed=timed, rss=rss)
    except (MesaUnavailable, BenchConfigError):
        raise
    except Exception as err:  # noqa: BLE001 - reported in the table
        if is_oom(err):
            result = Measurement(status="oom", error=_first_line(err))
        else:
            result = Measurement(status="error", error=f"{type(err).__name__}: {_first_line(err)}")
    # the exception (and the frames holding the model) is gone here
    release(device)
    result.wall_s = time.perf_counter() - started
    return result


def interleaved_step_times(rows: list[RowConfig], device: torch.device, *, seed: int = 0) -> list[list[float]]:
    """Step times (s) of ``rows`` measured round-robin: every row's model is built and warmed
    up first, then one step of each row in turn, ``max(steps)`` rounds (the starting row
    rotates), so slow drifts of a shared machine hit every row alike. Used for the
    throughput ratios of presets with ``interleave: true``."""
    if device.type == "cpu":
        CpuRss().for_speed()  # (see CpuRss: no page faults on every large tensor)
    steps = [warm_step(r, device, seed=seed, fresh_cache=False) for r in rows]
    times: list[list[float]] = [[] for _ in rows]
    for k in range(max(r.steps for r in rows)):
        for j in range(len(rows)):
            i = (j + k) % len(rows)
            if len(times[i]) >= rows[i].steps:
                continue
            synchronize(device)
            t0 = time.perf_counter()
            steps[i]()
            synchronize(device)
            times[i].append(time.perf_counter() - t0)
    del steps
    release(device)
    return times


def apply_step_times(row: RowConfig, result: Measurement, times: list[float]) -> None:
    """Replace ``result``'s speed figures by those of ``times`` (see interleaved_step_times)."""
    result.timed_steps = len(times)
    result.throughput = row.batch_size / statistics.median(times)
    result.throughput_mean = row.batch_size * len(times) / sum(times)
    result.step_ms_mean = 1000 * statistics.fmean(times)
    result.step_ms_median = 1000 * statistics.median(times)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__
