"""``ringpass bench``: what sequence parallelism buys on this hardware, measured side by side.

    ringpass bench --world-size 2 --seq-len 8192 16384             # one attention, every method
    ringpass bench --what model --world-size 2 --seq-len 16384     # a Llama-style training step
    ringpass bench --what decode --world-size 2 --seq-len 65536     # one decode step against a KV cache
    ringpass bench --what generate --world-size 2 --seq-len 8192    # a model's decode steps after a prompt
    ringpass bench --calibrate --json hardware.json                # this machine's link and kernel rate
    torchrun --nproc-per-node 8 -m ringpass.cli bench ...          # CUDA + NCCL: the launch's world size

On CPU the benchmark spawns fresh processes for each world size (gloo on 127.0.0.1, ``cores // P``
threads per rank unless ``--threads-per-rank``) and one process for each single-process baseline (one
thread, and the threads the ranks had together). Under ``torchrun`` it runs in the launched ranks, on
CUDA with NCCL where there is a GPU, and rank 0 runs the single-device baselines. Every case runs
``--warmup`` calls, then ``--repeats`` measured ones; a case's time is the slowest rank's per repeat,
reported as median and min..max. What each row reports (`results.summarise`) and how memory is measured
(`measure`) is documented there and in docs/performance.md.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lowering.costmodel import Hardware
from lowering.errors import InvalidInputError
from ringpass.cli.bench import attention, decode, model, results
from ringpass.cli.bench.measure import MMAP_THRESHOLD
from ringpass.cli.launch import spawn_ranks
from ringpass.hardware import default_hardware

RANK_FUNCTIONS = {
    "attention": attention.attention_rank,
    "model": model.model_rank,
    "decode": decode.decode_rank,
    "generate": decode.generate_rank,
}
WHAT = tuple(RANK_FUNCTIONS)
METHODS = {
    "attention": attention.METHODS,
    "model": model.METHODS,
    "decode": decode.METHODS,
    "generate": decode.GENERATE_METHODS,
}


@dataclass(frozen=True)
class BenchConfig:
    what: str = "attention"
    world_sizes: tuple[int, ...] = (2,)
    seq_lens: tuple[int, ...] = (4096,)
    batch: int = 1
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = True
    methods: tuple[str, ...] = attention.METHODS
    repeats: int = 5
    warmup: int = 1
    seed: int = 0
    threads_per_rank: int = 0  # 0: the machine's cores // P
    trace: str | None = None
    progress: bool = True
    timeout: float = 3600.0
    model: model.ModelSize = model.ModelSize()
    hf_config: str | None = None
    compiler: str = "aot_eager"
    new_tokens: int = 1  # decode: queries per step
    interleave: bool = False  # attention: measured calls in turns over the methods (`attention.measure_methods`)
    # attention or model: rows packed from documents of these lengths (`attention.PACKED_METHODS`,
    # `model.PACKED_METHODS`)
    packed: tuple[int, ...] = ()
    hardware: Hardware | None = None  # what predictions and the ``auto`` method use (`run_bench` sets it)

    def __post_init__(self):
        if self.what not in WHAT:
            raise InvalidInputError(f"bench: --what {self.what!r} is not one of {', '.join(WHAT)}.")
        if self.packed and (
            self.what not in ("attention", "model") or self.seq_lens != (sum(self.packed),) or min(self.packed) < 1
        ):
            raise InvalidInputError(
                "bench: --packed gives the document lengths of one row (--what attention or model); the row's "
                "length is their sum (no --seq-len)."
            )
        packed = {"attention": attention.PACKED_METHODS + attention.UNPACKED_METHODS, "model": model.PACKED_METHODS}
        known = packed[self.what] if self.packed else METHODS[self.what]
        unknown = [m for m in self.methods if m not in known]
        if unknown:
            raise InvalidInputError(
                f"bench: unknown method(s) {', '.join(unknown)} for --what {self.what}; "
                f"the methods are {', '.join(known)}."
            )
        if min(self.world_sizes) < 2 or min(self.seq_lens) < 1 or self.repeats < 1 or self.warmup < 0:
            raise InvalidInputError(
                "bench: world sizes must be at least 2 (the single-process baselines always run), "
                "sequence lengths and repeats positive."
            )
        if self.what == "decode" and not 1 <= self.new_tokens <= min(self.seq_lens):
            raise InvalidInputError(f"bench: --new-tokens {self.new_tokens} must be between 1 and the cache length.")
        if self.interleave and self.what != "attention":
            raise InvalidInputError(f"bench: --interleave is for --what attention, not --what {self.what}.")
        if self.what in ("attention", "decode") and self.dtype not in attention.DTYPES:
            raise InvalidInputError(f"bench: --dtype {self.dtype!r} is not one of {', '.join(attention.DTYPES)}.")

    def for_world_size(self, world_size: int) -> BenchConfig:
        """The config a ``world_size`` job runs with: threads per rank resolved."""
        threads = self.threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        return dataclasses.replace(self, threads_per_rank=threads)


def run_bench(config: BenchConfig, hardware=None) -> dict:
    """Run every case; the summary `results.summarise` makes of it (``rows``), with ``config`` and the
    ``hardware`` its predictions used."""
    hardware = hardware or default_hardware()
    config = dataclasses.replace(config, hardware=hardware)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        records = _in_launched_ranks(config)
        if records is None:
            return {}
    else:
        records = _spawned(config)
    return results.summarise(records, config, hardware)


def _rank_function(config: BenchConfig):
    return RANK_FUNCTIONS[config.what]


def _singles(config: BenchConfig) -> list[str]:
    return [m for m in config.methods if m == results.SINGLE_PROCESS[config.what]]


def _spawned(config: BenchConfig) -> list[dict]:
    previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # read by each spawned rank's malloc (measure.py)
    try:
        return _spawn_cases(config)
    finally:  # the caller's later processes start as they would have
        if previous is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = previous


def _spawn_cases(config: BenchConfig) -> list[dict]:
    distributed = [m for m in config.methods if m not in _singles(config)]
    thread_counts = sorted(
        {1} | {min(os.cpu_count() or 1, p * config.for_world_size(p).threads_per_rank) for p in config.world_sizes}
    )
    cases_per_len = len(distributed) * len(config.world_sizes) + len(_singles(config)) * len(thread_counts)
    total, done, records = cases_per_len * len(config.seq_lens), 0, []
    run = _rank_function(config)
    for p in config.world_sizes:
        if not distributed:
            continue
        job = config.for_world_size(p)
        records += spawn_ranks(run, p, (job, distributed, done, total), timeout=config.timeout)[0]
        done += len(distributed) * len(config.seq_lens)
    for threads in thread_counts if _singles(config) else ():
        job = dataclasses.replace(config, threads_per_rank=threads)
        records += spawn_ranks(run, 1, (job, _singles(config), done, total), timeout=config.timeout)[0]
        done += len(_singles(config)) * len(config.seq_lens)
    return records


def _in_launched_ranks(config: BenchConfig) -> list[dict] | None:
    """Under torchrun: this launch's world size, then the single-device baselines on rank 0. Rank 0 gets
    the records; the other ranks None."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        _GROUPS_STARTED.append(dist.group.WORLD)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    distributed = [m for m in config.methods if m not in _singles(config)]
    if world_size == 1 and distributed:
        raise InvalidInputError(
            f"bench: torchrun started one process; {', '.join(distributed)} need at least 2 "
            "(--nproc-per-node 2 or more), or ask for --methods "
            f"{results.SINGLE_PROCESS[config.what]} only."
        )
    job = dataclasses.replace(config.for_world_size(world_size), world_sizes=(world_size,))
    total = len(config.seq_lens) * (len(distributed) + len(_singles(config)))
    run = _rank_function(config)
    records = run(rank, world_size, job, distributed, 0, total) if distributed else []
    if rank == 0 and _singles(config):
        records += run(0, 1, job, _singles(config), len(distributed) * len(config.seq_lens), total)
    dist.barrier()
    return records if rank == 0 else None


_GROUPS_STARTED: list = []  # the process group the bench started in a torchrun rank, to end it there


def end_launched_rank() -> None:
    """End a torchrun rank after the bench (the command line's last step): destroy the process group the
    bench started and leave at once, since gloo's threads can abort the interpreter's own exit ("terminate
    called without an active exception") after the results are written."""
    import sys

    if _GROUPS_STARTED and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
