"""What conversion costs and what it runs at: convert, save and load times and the artifact's size, then the
median training-step time (forward, loss, backward) of the loaded converted model against the same model
compiled with the ring backend (aot_eager and Inductor). The Llama-style model of convert_and_run.py,
batch 1, one thread per rank.

    torchrun --standalone --nproc-per-node 2 examples/convert_cost.py [seq_len] [steps]

Rank 0 prints the numbers; docs/convert.md records them.
"""

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from convert_and_run import Llama

import ringpass


def median_seconds(run, steps: int) -> float:
    run()  # warm-up: the first call compiles or checksums
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    seq_len, steps = (int(a) for a in (sys.argv[1:] + ["4096", "5"][len(sys.argv[1:]) :]))
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Llama()
    ids = torch.randint(0, 256, (1, seq_len))
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}
    path = os.path.join(tempfile.gettempdir(), f"ringpass-cost-{dist.get_rank()}.pt2")
    started = time.perf_counter()
    converted = ringpass.convert(model, batch, world_size=dist.get_world_size())
    converted_at = time.perf_counter()
    converted.save(path)
    saved_at = time.perf_counter()
    loaded = ringpass.load(path)
    loaded_at = time.perf_counter()

    def step(module):
        def run():
            module(**batch).backward()
            module.zero_grad()

        return run

    times = {"loaded converted model (eager)": median_seconds(step(loaded), steps)}
    for compiler in ("aot_eager", "inductor"):
        compiled = torch.compile(model, backend=ringpass.backend(compiler=compiler, report="off"))
        times[f"backend='ring', compiler={compiler}"] = median_seconds(step(compiled), steps)
    if dist.get_rank() == 0:
        print(
            f"convert {converted_at - started:.2f} s, save {saved_at - converted_at:.2f} s, load "
            f"{loaded_at - saved_at:.2f} s, artifact {os.path.getsize(path) / 2**20:.2f} MiB"
        )
        for name, seconds in times.items():
            print(f"{name}: {seconds * 1000:.0f} ms per training step (N={seq_len}, P={dist.get_world_size()})")
    os.remove(path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
