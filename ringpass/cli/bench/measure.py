"""How ``ringpass bench`` measures one call: wall time, and peak memory above what was held before it.

CPU: the process's peak resident set (``VmHWM`` in ``/proc/self/status``) is reset by writing ``5`` to
``/proc/self/clear_refs`` just before the call and read after it; the peak minus the resident set at the
reset is the call's memory. For freed memory not to be counted, ``ringpass bench`` starts its ranks with
``MALLOC_MMAP_THRESHOLD_=131072``: every allocation over 128 KiB (every tensor that matters) is then a
mapping of its own that goes back to the OS when freed, so the resident set follows live tensors and a
call's peak is not hidden by memory a previous call freed. CUDA: ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats``, minus what was allocated at the start (the allocator's cache not counted).
"""

from __future__ import annotations

import os
import re
import sys
import time

import torch

MMAP_THRESHOLD = "131072"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE).group(1))


class PeakMemory:
    """``start()`` before a call, ``peak()`` (bytes above the start) at any point after it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.unavailable: str | None = None
        if device.type == "cpu":
            if not os.path.exists("/proc/self/clear_refs"):
                self.unavailable = "peak memory on CPU needs Linux's /proc/self/clear_refs"
            elif os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
                self.unavailable = (
                    "peak memory on CPU needs MALLOC_MMAP_THRESHOLD_=131072 set before the process "
                    "starts (ringpass bench sets it for the ranks it spawns; export it under torchrun)"
                )

    def start(self) -> None:
        if self.unavailable:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
            self._base = _status_kib("VmRSS") * 1024

    def peak(self) -> int | None:
        if self.unavailable:
            return None
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self._base
        return max(0, _status_kib("VmHWM") * 1024 - self._base)


def bench_device() -> torch.device:
    """CUDA (this launch's local rank) under torchrun on a machine with GPUs, else the CPU."""
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Progress:
    """A one-line progress bar on stderr: ``bench [#####-----] 5/10 ring zigzag P=2 N=4096``."""

    WIDTH = 24

    def __init__(self, total: int, done: int = 0, enabled: bool = True):
        self.total, self.done, self.enabled = total, done, enabled and total > 0

    def advance(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = round(self.WIDTH * self.done / self.total)
        sys.stderr.write(f"\rbench [{'#' * filled}{'-' * (self.WIDTH - filled)}] {self.done}/{self.total} {label:<48}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def seconds_since(start: float, device: torch.device) -> float:
    synchronize(device)
    return time.perf_counter() - start


def write_trace(call, device: torch.device, path: str) -> None:
    """Run ``call()`` once more under ``torch.profiler`` and write its Chrome/Perfetto trace to ``path``
    (the ring's steps show as ``ringpass forward step 0: compute`` and so on)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with torch.profiler.profile(activities=activities) as profiler:
        call()
    profiler.export_chrome_trace(path)


def start_rank(rank: int, config, progress_done: int, progress_total: int):
    """(this rank's device, its progress bar: rank 0's only) for a bench job, the CPU thread count set from
    ``config.threads_per_rank``."""
    device = bench_device()
    if config.threads_per_rank and device.type == "cpu":
        torch.set_num_threads(config.threads_per_rank)
    return device, Progress(progress_total, progress_done, enabled=rank == 0 and config.progress)


def gather_record(
    mine: dict, *, method: str, world_size: int, seq_len: int, device: torch.device, messages=None
) -> dict:
    """One case's record: every rank's measurements (``mine`` on this rank), gathered on every rank."""
    ranks = [mine]
    if world_size > 1:
        import torch.distributed as dist

        ranks = [None] * world_size
        dist.all_gather_object(ranks, mine)
    return {
        "method": method,
        "world_size": world_size,
        "seq_len": seq_len,
        "threads": torch.get_num_threads(),
        "device": device.type,
        "ranks": ranks,
        "messages": messages,
    }
