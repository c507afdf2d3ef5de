"""The ``ringpass`` command line: ``demo`` (the ring on CPU processes), ``inspect`` (what the pass does
to a model, offline), ``convert`` (apply it once and save the result for ``ringpass.load``), ``plan``
(whether the ring pays on given hardware, predicted) and ``bench`` (what it buys, measured). Exit
status of ``inspect``: 0 every attention rewritten, 2 refused, 3 no attention found, 1 a bad command line
or a target that could not be loaded; of ``convert``: 0 written, 2 refused, 1 anything else. Every command
prints a ringpass error as ``ringpass <command>: <what was wrong>`` and exits 1 (``convert`` 2 for a refusal)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from lowering import compat
from lowering.errors import InvalidInputError, NotSupportedError, RingpassError
from ringpass.cli import demo
from ringpass.options import CHOICES

# the backend options that change the rewrite
INSPECT_OPTIONS = ("layout", "inputs", "outputs", "grads", "masks", "strategy")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit 1 on usage errors: 2 means "refused" for inspect
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(1)


def main(argv=None) -> int:
    parser = _Parser(prog="ringpass", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _demo_arguments(commands.add_parser("demo", help="ring attention on CPU processes against unsharded SDPA"))
    _inspect_arguments(
        commands.add_parser(
            "inspect",
            help="what the ring pass will do to a model, offline (no GPU, no process group)",
            description="Capture TARGET's model as the ring backend would and show, for --world-size ranks, every "
            "attention found, what is sharded, gathered and all-reduced, the ring's schedule, bytes, FLOPs "
            "and per-rank memory, and any refusal with its source line and chain of ops.",
        )
    )
    _convert_arguments(
        commands.add_parser(
            "convert",
            help="apply the ring pass once and save the model for ringpass.load (no GPU, no process group)",
            description="Capture TARGET's model, rewrite it for --world-size ranks, print what was done (as inspect "
            "does) and write a torch.export artifact that ringpass.load reads on every rank (docs/convert.md).",
        )
    )
    _plan_arguments(
        commands.add_parser(
            "plan",
            help="predict whether the ring pays for an attention on given hardware (lowering.costmodel)",
            description="Predict each ring step's compute and transfer for an attention's shape on a link and device "
            "(presets or numbers), whether the transfer hides, memory per rank, the all-gather alternative, "
            "and recommend ring, all-gather or no ring (decode).",
        )
    )
    _bench_arguments(
        commands.add_parser(
            "bench",
            help="measure ring, all-gather and unsharded side by side: time, memory per rank, overlap",
            description="Run one attention (--what attention), a model's training step (--what model), one decode "
            "step against a KV cache (--what decode) or a model's decode steps (--what generate) by every method "
            "on fresh CPU processes (or under torchrun, on its ranks), and print median time, per-rank peak "
            "memory, parallel efficiency, hidden communication, work balance and the cost model's prediction "
            "(docs/performance.md).",
        )
    )
    args = parser.parse_args(argv)
    run = {"demo": _demo, "inspect": _inspect, "convert": _convert, "plan": _plan, "bench": _bench}[args.command]
    try:
        return run(args)
    except RingpassError as error:
        if error.__cause__ is not None:  # the model's own failure: where it happened
            traceback.print_exception(error.__cause__, file=sys.stderr)
        # the library's messages may name the front end already ("plan: give --link ..."): say it once
        print(f"ringpass {args.command}: {str(error).removeprefix(f'{args.command}: ')}", file=sys.stderr)
        return 2 if args.command == "convert" and isinstance(error, NotSupportedError) else 1


def _demo_arguments(d) -> None:
    defaults = demo.DemoConfig()
    d.add_argument("--world-size", type=int, default=defaults.world_size, help="processes in the ring")
    d.add_argument("--seq-len", type=int, default=defaults.seq_len)
    d.add_argument("--batch", type=int, default=defaults.batch)
    d.add_argument("--heads", type=int, default=defaults.heads, help="query heads")
    d.add_argument("--kv-heads", type=int, default=defaults.kv_heads, help="key/value heads (GQA)")
    d.add_argument("--head-dim", type=int, default=defaults.head_dim)
    d.add_argument("--dtype", choices=sorted(demo.DTYPES), default=defaults.dtype)
    d.add_argument("--bidirectional", action="store_true", help="no causal mask")
    d.add_argument("--layout", choices=["auto", "zigzag", "contiguous"], default=defaults.layout)
    d.add_argument("--timeout", type=float, default=600.0, help="seconds before every rank is stopped")


def _demo(args) -> int:
    config = demo.DemoConfig(
        world_size=args.world_size,
        batch=args.batch,
        heads=args.heads,
        kv_heads=args.kv_heads,
        seq_len=args.seq_len,
        head_dim=args.head_dim,
        dtype=args.dtype,
        causal=not args.bidirectional,
        layout=args.layout,
    )
    print(demo.format_report(demo.run_demo(config, timeout=args.timeout)))
    return 0


def _target_arguments(i, built: str) -> None:
    """TARGET or --hf-config, the sizes, the ring's world size and the backend options that change the rewrite."""
    i.add_argument(
        "target",
        nargs="?",
        help="path/to/file.py:factory or package.module:factory, a callable returning (model, example_inputs)",
    )
    i.add_argument(
        "--hf-config",
        metavar="CONFIG",
        help=f"a local Hugging Face config.json (or its folder) instead of TARGET: built {built}, token ids as input",
    )
    i.add_argument("--labels", action="store_true", help="with --hf-config: a training step (labels, train mode)")
    i.add_argument("--world-size", type=int, required=True, help="ranks in the ring (any number, on any machine)")
    i.add_argument(
        "--seq-len",
        type=int,
        help="sequence length (passed to the factory; --hf-config: default max_position_embeddings)",
    )
    i.add_argument("--batch", type=int, help="batch size (passed to the factory; --hf-config: default 1)")
    for name, choices in CHOICES.items():
        if name in INSPECT_OPTIONS:
            i.add_argument(f"--{name}", choices=choices, help="backend option (see docs/backend.md)")
    i.add_argument(
        "--hardware",
        metavar="LINK/DEVICE|FILE",
        help="what --strategy auto predicts on: preset names (nvlink/h100, infiniband/a100, loopback/cpu ...) or a "
        "`ringpass bench --calibrate --json` file (default: this machine's kind)",
    )


def _target(args, device: str) -> tuple:
    """(model, example inputs, backend options) the command line names."""
    from ringpass.inspection.targets import call_factory, hf_config_model, load_factory

    if (args.target is None) == (args.hf_config is None):
        raise InvalidInputError("give either TARGET or --hf-config CONFIG")
    if args.hf_config:
        model, inputs = hf_config_model(args.hf_config, args.seq_len, args.batch or 1, args.labels, device=device)
    else:
        if args.labels:
            raise InvalidInputError("--labels goes with --hf-config (a factory returns its own inputs)")
        model, inputs = call_factory(load_factory(args.target), args.seq_len, args.batch)
    options = {name: getattr(args, name) for name in (*INSPECT_OPTIONS, "hardware") if getattr(args, name) is not None}
    return model, inputs, options


def _inspect_arguments(i) -> None:
    _target_arguments(i, "on the meta device")
    i.add_argument("--json", metavar="FILE", help="write the findings as JSON (docs/inspect.md)")
    i.add_argument("--graphml", metavar="FILE", help="write the rewritten graph as GraphML (networkx)")
    i.add_argument(
        "--picture",
        metavar="FILE",
        action="append",
        default=[],
        help="draw the condensed graph and the ring schedule (.png or .svg; needs ringpass[viz])",
    )
    i.add_argument("--code", action="store_true", help="print the rewritten FX code")


def _inspect(args) -> int:
    from ringpass.inspection.inspector import inspect

    model, inputs, options = _target(args, "meta")
    inspection = inspect(model, inputs, world_size=args.world_size, **options)
    print(inspection)
    if args.code:
        print(inspection.code())
    if args.json:
        inspection.write_json(args.json)
    if args.graphml:
        inspection.write_graphml(args.graphml)
    for picture in args.picture:
        inspection.write_picture(picture)
    return inspection.exit_code


def _convert_arguments(c) -> None:
    _target_arguments(c, "on the CPU with random weights")
    c.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the artifact (.pt2)")
    c.add_argument("--dynamic", action="store_true", help="a symbolic sequence length: one artifact for many lengths")


def _convert(args) -> int:
    from ringpass.conversion.converter import convert

    model, inputs, options = _target(args, "cpu")
    converted = convert(model, inputs, world_size=args.world_size, dynamic=args.dynamic, **options)
    print(converted.report)
    converted.save(args.output)
    print(f"ringpass convert: wrote {args.output} (load it on each of {args.world_size} ranks with ringpass.load)")
    return 0


ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}


def _plan_arguments(p) -> None:
    from lowering.costmodel import DEVICES, LINKS

    p.add_argument(
        "target",
        nargs="?",
        help="a whole model: path/to/file.py:factory or package.module:factory returning (model, example_inputs)",
    )
    p.add_argument("--hf-config", metavar="CONFIG", help="a whole model: a local Hugging Face config.json (or folder)")
    p.add_argument("--world-size", type=int, required=True, help="ranks (a whole model: the ring's ranks at most)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--heads", type=int, help="one attention: query heads")
    p.add_argument("--kv-heads", type=int, help="one attention: key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, help="one attention: head dimension")
    p.add_argument("--batch", type=int, default=1)
    wrap = p.add_mutually_exclusive_group()
    wrap.add_argument("--fsdp", action="store_true", help="a whole model: FSDP2 over every rank")
    wrap.add_argument("--ddp", action="store_true", help="a whole model: DDP over every rank")
    p.add_argument("--checkpointing", action="store_true", help="a whole model: activation checkpointing")
    p.add_argument("--optimizer", choices=["adamw", "sgd", "none"], default="adamw", help="a whole model")
    p.add_argument("--gpu-mem", type=float, metavar="GIB", help="a whole model: memory of one device, GiB")
    p.add_argument(
        "--strategy",
        choices=["ring", "auto"],
        default="ring",
        help="a whole model: every attention a ring, or each by the fastest predicted strategy (ring, Ulysses x "
        "ring, all-gather), as the backend's strategy='auto' picks",
    )
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32", "fp64"], default="bf16")
    p.add_argument("--bidirectional", action="store_true", help="no causal mask")
    p.add_argument("--layout", choices=["auto", "zigzag", "contiguous"], default="auto")
    p.add_argument("--decode", action="store_true", help="one query per step against a cache")
    p.add_argument(
        "--ulysses",
        type=int,
        metavar="U",
        help="also predict Ulysses x ring: all-to-all inside groups of U "
        "ranks over --ulysses-link, the ring across groups over --link",
    )
    p.add_argument("--ulysses-link", choices=sorted(LINKS), default="nvlink", help="the links inside a Ulysses group")
    p.add_argument(
        "--link", choices=sorted(LINKS), help="; ".join(f"{k}: {v[2]}" for k, v in LINKS.items()).replace("%", "%%")
    )
    p.add_argument("--bandwidth", type=float, metavar="GB/S", help="link bandwidth one way (overrides --link)")
    p.add_argument("--latency", type=float, metavar="US", help="link latency per message (overrides --link)")
    p.add_argument(
        "--device",
        choices=sorted(DEVICES),
        help="; ".join(f"{k}: {v[1]}" for k, v in DEVICES.items()).replace("%", "%%"),
    )
    p.add_argument("--tflops", type=float, help="attention TFLOP/s one rank reaches (overrides --device)")
    p.add_argument("--hardware", metavar="FILE", help="link and device from `ringpass bench --calibrate --json FILE`")
    p.add_argument("--json", metavar="FILE", help="write the prediction as JSON")


def _plan(args) -> int:
    import json

    from lowering.costmodel import AttentionShape
    from ringpass.hardware import hardware, load_hardware
    from ringpass.planning.plan import make_plan

    if args.hardware:
        hw = load_hardware(args.hardware)
    else:
        hw = hardware(
            args.link, args.device, bandwidth_gb_s=args.bandwidth, latency_us=args.latency, tflops=args.tflops
        )
    if args.target or args.hf_config:
        plan = _model_plan(args, hw)
    else:
        if args.heads is None or args.head_dim is None:
            raise InvalidInputError(
                "plan: give a whole model (TARGET or --hf-config CONFIG) or one attention's --heads and --head-dim."
            )
        shape = AttentionShape(
            args.batch,
            args.heads,
            args.kv_heads or args.heads,
            args.head_dim,
            ITEMSIZE[args.dtype],
            is_causal=not args.bidirectional,
        )
        plan = make_plan(
            shape,
            args.world_size,
            args.seq_len,
            hw,
            decode=args.decode,
            layout=args.layout,
            ulysses=args.ulysses,
            ulysses_link=hardware(args.ulysses_link, tflops=1.0) if args.ulysses else None,
        )
    print(plan)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan.as_dict(), f, indent=1)
    return 0


def _model_plan(args, hw):
    """The whole-model plan (`ringpass.planning.model_plan`): the attentions from `inspect` on the meta device, the step
    measured on fake tensors."""
    import torch

    from ringpass.inspection.inspector import inspect
    from ringpass.inspection.targets import call_factory, hf_config_model, load_factory
    from ringpass.planning.model_plan import PLAN_ATTENTION, hf_plan_attention, plan_model

    if (args.target is None) == (args.hf_config is None):
        raise InvalidInputError("plan: give either TARGET or --hf-config CONFIG")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}[args.dtype]
    if args.hf_config:
        hf_plan_attention()

        def build(tokens, device="cpu", attention=PLAN_ATTENTION):
            return hf_config_model(args.hf_config, tokens, args.batch, True, device, attention, dtype)

        model, inputs = build(args.seq_len, "meta", "sdpa")
        if not compat.supports_attention_backend(model):
            raise NotSupportedError(
                f"plan: {type(model).__name__} runs its own attention code, not through transformers' attention "
                "interface, so the plan cannot run its step as the ring does (without the S x S scores). "
                "`ringpass inspect --hf-config` shows what the ring does with it."
            )
    else:
        factory = load_factory(args.target)

        def build(tokens):
            default = torch.get_default_dtype()
            torch.set_default_dtype(dtype)  # the factory's floating tensors in --dtype
            try:
                return call_factory(factory, tokens, args.batch)
            finally:
                torch.set_default_dtype(default)

        with torch.device("meta"):
            model, inputs = build(args.seq_len)
    inspection = inspect(model, inputs, world_size=max(args.world_size, 2))
    attentions = [a for report in inspection.reports for a in report.attention]
    refused = [report.refusal.message for report in inspection.reports if report.refusal is not None]
    if refused:
        raise InvalidInputError(f"plan: the ring refuses this model: {refused[0]}")
    wrapper = "fsdp" if args.fsdp else "ddp" if args.ddp else "none"
    return plan_model(
        build,
        args.seq_len,
        args.world_size,
        hw,
        attentions=attentions,
        wrapper=wrapper,
        checkpointing=args.checkpointing,
        optimizer=args.optimizer,
        gpu_mem=args.gpu_mem,
        strategy=args.strategy,
    )


def _bench_arguments(b) -> None:
    from ringpass.cli.bench import model

    size = model.ModelSize()
    b.add_argument("--what", choices=["attention", "model", "decode", "generate"], default="attention")
    b.add_argument("--world-size", type=int, nargs="+", default=[2], help="ranks (one job per value)")
    b.add_argument("--seq-len", type=int, nargs="+", help="sequence lengths (default 4096)")
    b.add_argument(
        "--packed",
        nargs="+",
        metavar="LENGTHS",
        help="one row packed from documents of these lengths (512x16: sixteen of 512), attention inside each; "
        "attention methods sdpa (one call per document) all-gather ring-contiguous ring-zigzag ring-documents "
        "(and on request ring-padded: each document its own row, padded to the longest); "
        "model methods (position ids restarting at each document) ring ring-documents unsharded",
    )
    b.add_argument(
        "--methods",
        nargs="+",
        help="attention: sdpa all-gather ring-contiguous ring-zigzag context-parallel (default: all); model: ring "
        "unsharded (--packed: ring-documents too); decode: sdpa sharded gathered; generate: unsharded sharded gathered",
    )
    b.add_argument("--new-tokens", type=int, default=1, help="decode: queries per step (--seq-len: the cache length)")
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--heads", type=int, help=f"query heads (attention default 8, model {size.heads})")
    b.add_argument("--kv-heads", type=int, help=f"key/value heads (attention default 2, model {size.kv_heads})")
    b.add_argument("--head-dim", type=int, default=64, help="attention and decode")
    b.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="attention and decode"
    )
    b.add_argument("--bidirectional", action="store_true", help="attention without a causal mask")
    b.add_argument("--hidden", type=int, default=size.hidden, help="model: hidden size")
    b.add_argument("--layers", type=int, default=size.layers, help="model: decoder layers")
    b.add_argument("--intermediate", type=int, default=size.intermediate, help="model: MLP width")
    b.add_argument("--vocab", type=int, default=size.vocab, help="model: vocabulary")
    b.add_argument("--hf-config", metavar="CONFIG", help="model: a Hugging Face config.json instead (random weights)")
    b.add_argument(
        "--compiler",
        choices=["inductor", "aot_eager", "eager"],
        default="inductor",
        help="model: what compiles both the ring's graph and the unsharded model",
    )
    b.add_argument("--repeats", type=int, default=5, help="measured calls per case")
    b.add_argument("--warmup", type=int, default=1, help="unmeasured calls first")
    b.add_argument(
        "--interleave",
        action="store_true",
        help="attention: warm every method first, then measure in turns over the methods (drift hits all alike)",
    )
    b.add_argument("--threads-per-rank", type=int, default=0, help="default: cores // world size")
    b.add_argument("--hardware", metavar="FILE", help="predict with this calibration (default: loopback + cpu presets)")
    b.add_argument("--calibrate", action="store_true", help="measure this machine's link and kernel rate instead")
    b.add_argument("--json", metavar="FILE", help="write the results as JSON")
    b.add_argument("--plot", metavar="FILE", help="write a PNG of time and memory per method and world size")
    b.add_argument("--trace", metavar="DIR", help="write a Chrome/Perfetto trace per method, size and rank")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--timeout", type=float, default=3600.0, help="seconds before a job's ranks are stopped")


def _default_methods(bench, what: str, packed: tuple) -> tuple:
    if packed and what in ("attention", "model"):
        return bench.attention.PACKED_METHODS if what == "attention" else bench.model.PACKED_METHODS
    return bench.METHODS[what]


def _document_lengths(words: list[str]) -> tuple[int, ...]:
    """``--packed 24576 512x16``: the lengths, ``LxK`` standing for K documents of L tokens."""
    lengths = []
    for word in words:
        length, _, count = word.partition("x")
        if not (length.isdigit() and (count.isdigit() or not count)) or int(length) < 1:
            raise InvalidInputError(f"bench: --packed {word!r}: give lengths as 512 or 512x16 (sixteen of 512).")
        lengths += [int(length)] * (int(count) if count else 1)
    return tuple(lengths)


def _bench(args) -> int:
    from ringpass.cli import bench
    from ringpass.cli.bench import calibrate, model, results
    from ringpass.hardware import load_hardware

    if args.calibrate:
        data = calibrate.calibrate(timeout=args.timeout)
        print(calibrate.format_calibration(data))
        if args.json:
            results.write_json(data, args.json)
        return 0
    size = model.ModelSize(
        args.hidden,
        args.layers,
        args.heads or model.ModelSize.heads,
        args.kv_heads or model.ModelSize.kv_heads,
        args.intermediate,
        args.vocab,
    )
    packed = _document_lengths(args.packed) if args.packed else ()
    if packed and args.seq_len:
        raise InvalidInputError("bench: --packed gives the row's length (the documents' sum); drop --seq-len.")
    config = bench.BenchConfig(
        what=args.what,
        world_sizes=tuple(args.world_size),
        seq_lens=(sum(packed),) if packed else tuple(args.seq_len or [4096]),
        batch=args.batch,
        heads=args.heads or 8,
        kv_heads=args.kv_heads or 2,
        head_dim=args.head_dim,
        dtype=args.dtype,
        causal=not args.bidirectional,
        methods=tuple(args.methods or _default_methods(bench, args.what, packed)),
        repeats=args.repeats,
        warmup=args.warmup,
        threads_per_rank=args.threads_per_rank,
        trace=args.trace,
        progress=not args.no_progress,
        timeout=args.timeout,
        model=size,
        hf_config=args.hf_config,
        compiler=args.compiler,
        new_tokens=args.new_tokens,
        interleave=args.interleave,
        packed=packed,
    )
    summary = bench.run_bench(config, load_hardware(args.hardware) if args.hardware else None)
    if summary:  # not a torchrun rank other than 0
        print(results.format_table(summary))
        if args.json:
            results.write_json(summary, args.json)
        if args.plot:
            results.plot(summary, args.plot)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        bench.end_launched_rank()
    return 0
