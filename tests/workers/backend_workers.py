"""What each rank runs in the backend tests: a tiny model compiled with the ring backend against the
same model run whole in one process (fp64, the same seed on every rank)."""

from __future__ import annotations

import logging
import os
import time
import traceback
from pathlib import Path

import models
import torch
import torch.distributed as dist
import torch.nn.functional as F
from reference import grad_error, rel_err

import ringpass
from lowering import record_ring_events
from lowering.events import scored_pairs

MODELS = {
    "gpt": lambda: models.GPT(),
    "gpt_regions": lambda: models.GPT(regions=True),
    "torch_layers": lambda: models.TorchLayers(),
    "llama": lambda: models.Llama(),
    "llama_repeat_kv": lambda: models.Llama(repeat_kv=True),
    "position_table_pooling": lambda: models.PositionTableAndPooling(),
    "hand_written": lambda: models.HandWritten(),
    "encoder": lambda: models.Encoder(),
    "encoder_padded": lambda: models.Encoder(),
    "encoder_mask_input": lambda: models.Encoder(),
    "hand_written_packed": lambda: models.HandWritten(),
    "hand_written_one_packing": lambda: models.HandWritten(),
    "hand_written_mixed_documents": lambda: models.HandWritten(),
    **{f"packed_{given}": (lambda given=given: models.PackedAttention(given)) for given in ("cu_seqlens", "positions")},
    "learned_bias": lambda: models.LearnedBias(),
    "learned_bias_padded": lambda: models.LearnedBias(causal=False),
    "square_bias": lambda: models.SquareBias(),
    "gpt_with_loss": lambda: models.WithLoss(models.GPT()),
    "llama_last_tokens": lambda: models.LastTokens(models.Llama()),
    **{f"spelling_{name}": (lambda name=name: models.Spellings(name)) for name in models.SPELLINGS},
}


# hand_written_mixed_documents: every row packed alike from these (one longer than a rank's span at P >= 2, two shorter
# than a kernel tile, none of lengths that divide by anything)
MIXED_DOCUMENTS = (900, 1, 7, 333, 200, 59)


def _inputs(name: str, seq_len: int, batch: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    if name.startswith("encoder"):
        x = torch.randn(batch, seq_len, 32, generator=generator, dtype=torch.float64)
        keep = torch.rand(batch, seq_len, generator=generator) > 0.3
        keep[:, 0] = True  # every query sees a key
        if name == "encoder_padded":
            return x, keep
        if name == "encoder_mask_input":  # a sequence x sequence mask made by the caller
            return x, None, keep[:, None, :, None] | keep[:, None, None, :]
        return (x,)
    if name.startswith("packed_"):  # documents of random lengths, every row packed alike
        x = torch.randn(batch, seq_len, 16, generator=generator, dtype=torch.float64)
        starts = (torch.rand(seq_len, generator=generator) < 0.3).nonzero().flatten().tolist()
        cuts = sorted({0, *starts, seq_len})
        if name == "packed_cu_seqlens":
            return x, torch.tensor(cuts)
        positions = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])
        return x, positions.expand(batch, -1).contiguous()
    ids = torch.randint(0, 61, (batch, seq_len), generator=generator)
    if name == "hand_written_packed":  # documents of random lengths packed into each row
        return ids, (torch.rand(batch, seq_len, generator=generator) < 0.3).cumsum(dim=1)
    if name == "hand_written_mixed_documents":
        assert seq_len == sum(MIXED_DOCUMENTS), seq_len
        lengths = torch.tensor(MIXED_DOCUMENTS)
        return ids, torch.repeat_interleave(torch.arange(len(lengths)), lengths).expand(batch, -1).contiguous()
    if name == "hand_written_one_packing":  # every row packed alike: the ring plans each document's pairs
        return ids, (torch.rand(1, seq_len, generator=generator) < 0.3).cumsum(dim=1).expand(batch, -1).contiguous()
    if name in ("torch_layers", "learned_bias_padded"):  # a key padding mask; every query keeps its first key
        keep = torch.rand(batch, seq_len, generator=generator) > 0.3
        keep[:, 0] = True
        return ids, keep
    if name == "gpt_with_loss":
        labels = torch.randint(0, 61, (batch, seq_len), generator=generator)
        labels[:, ::5] = -100  # some ignored tokens
        return ids, labels
    return (ids,)


def _loss(outputs, weights):
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return sum((o * w).sum() for o, w in zip(outputs, weights))


def compare(
    rank: int,
    world_size: int,
    name: str,
    seq_len: int,
    options: dict,
    dynamic,
    group=None,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    specialize_float: bool = False,
) -> dict:
    """Relative errors of outputs and parameter gradients on this rank, and the graph's op counts; with
    ``specialize_float`` Dynamo reads the model's Python floats as constants."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = MODELS[name]().to(dtype)
    inputs = tuple(
        t.to(dtype) if t is not None and t.is_floating_point() else t
        for t in _inputs(name, seq_len, batch=2, seed=seed)
    )
    expected = model(*inputs)
    expected_tuple = expected if isinstance(expected, tuple) else (expected,)
    weights = [torch.randn(e.shape, generator=torch.Generator().manual_seed(7)).to(e.dtype) for e in expected_tuple]
    _loss(expected, weights).backward()
    expected_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()

    backend = ringpass.backend(**options, **({"group": group} if group is not None else {}))
    graphs = []
    inner = options.get("compiler", "aot_eager")

    def capture(gm, example_inputs):
        compiled = backend(gm, example_inputs)
        graphs.append(gm)
        return compiled

    compiled_inputs = inputs
    ring_group = group.get_group() if hasattr(group, "get_group") else group
    ring_world = dist.get_world_size(ring_group) if group is not None else world_size
    ring_rank = dist.get_rank(ring_group) if group is not None else rank
    if options.get("inputs") == "sharded":  # the helper users call (zigzag: what layout="auto" gives sharded inputs)
        compiled_inputs = tuple(
            ringpass.shard(t, 1, layout=options.get("layout", "zigzag"), group=group) for t in inputs
        )
    with torch._dynamo.config.patch(specialize_float=specialize_float), record_ring_events() as events:
        outputs = torch.compile(model, backend=capture, fullgraph=True, dynamic=dynamic)(*compiled_inputs)
    outputs_tuple = outputs if isinstance(outputs, tuple) else (outputs,)
    documents = inputs[1] if options.get("layout") == "documents" else None  # the `doc` ids (hand_written_*)
    if options.get("outputs") == "sharded":
        weights_used = [
            layout_shard(options, ring_world, seq_len, w, ring_rank, documents)
            if w.dim() >= 2 and w.shape[1] == seq_len
            else w
            for w in weights
        ]
        expected_cmp = [
            layout_shard(options, ring_world, seq_len, e, ring_rank, documents)
            if e.dim() >= 2 and e.shape[1] == seq_len
            else e
            for e in expected_tuple
        ]
    else:
        weights_used, expected_cmp = weights, expected_tuple
    with record_ring_events() as backward_events:
        _loss(outputs, weights_used).backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    gathered = []  # sharded outputs reassembled with ringpass.unshard equal the whole outputs
    if options.get("outputs") == "sharded":
        gathered = [
            rel_err(
                ringpass.unshard(
                    o.detach(),
                    1,
                    seq_len=seq_len,
                    layout=options.get("layout", "zigzag"),
                    group=group,
                    documents=documents,
                ),
                e.detach(),
            )
            for o, e in zip(outputs_tuple, expected_tuple)
            if e.dim() >= 2 and e.shape[1] == seq_len
        ]
    result = {
        "outputs": [rel_err(o.detach(), e.detach()) for o, e in zip(outputs_tuple, expected_cmp)] + gathered,
        "report": backend.reports[-1].as_dict() if backend.reports else {},
        "report_text": str(backend.reports[-1]) if backend.reports else "",
        "ops": _op_counts(graphs[-1]) if graphs else {},
        "inner": inner,
        "pairs": scored_pairs(events),  # what this rank's forward kernels scored
        # document ids a ring call copied to the host itself (the graph passes its one copy per call)
        "ids_copied": sum(e.kind == "documents_to_host" for e in (*events, *backward_events)),
    }
    if options.get("grads") in ("local", "mean"):  # the sum (local) or the mean (mean) over the ring is the gradient
        combined = {}
        for k, g in grads.items():
            g = g.clone()
            dist.all_reduce(g, group=ring_group)
            combined[k] = g / ring_world if options["grads"] == "mean" else g
        result["grads"] = grad_error(combined, expected_grads)
    else:
        result["grads"] = grad_error(grads, expected_grads)
    return result


def layout_shard(options, world, seq_len, tensor, rank, documents=None):
    """This rank's shard of ``tensor`` in the options' layout (the documents layout: of the ``documents`` ids)."""
    from lowering.documents import sequence_layout

    return sequence_layout(options.get("layout", "zigzag"), world, seq_len, documents).shard(tensor, 1, rank)


def _op_counts(gm) -> dict:
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
            counts[str(name)] = counts.get(str(name), 0) + 1
    return counts


def run_cases(rank: int, world_size: int, cases: list, record_dir: str) -> None:
    """Runs ``cases`` ((case id, compare's arguments after world_size as a dict)) in order and records in
    ``record_dir``, for the harness to read whatever becomes of the spawn: ``started-<rank>``, the id of the
    case this rank is running, and ``<index>-<rank>.pt``, each case's result or ``{"error": traceback}``.
    After an error the rank goes on once every rank has recorded that case; if one does not within
    `PEER_WAIT` s (it may wait in a collective the failed rank never joins), the rank raises, ending the spawn:
    the harness runs the cases after it in a fresh one."""
    for index, (case_id, kwargs) in enumerate(cases):
        Path(record_dir, f"started-{rank}").write_text(case_id)
        try:
            result = compare(rank, world_size, **kwargs)
        except Exception:
            result = {"error": traceback.format_exc()}
        written = Path(record_dir, f"{index}-{rank}.pt")
        torch.save(result, written.with_suffix(".partial"))
        os.replace(written.with_suffix(".partial"), written)  # whole or absent, should the spawn be killed
        if "error" in result:
            _wait_for_every_rank(Path(record_dir), index, case_id, world_size)


PEER_WAIT = 60


def _wait_for_every_rank(record_dir: Path, index: int, case_id: str, world_size: int) -> None:
    deadline = time.monotonic() + PEER_WAIT
    while not all((record_dir / f"{index}-{rank}.pt").exists() for rank in range(world_size)):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"case {case_id} raised on this rank and another rank did not finish it within "
                f"{PEER_WAIT} s: the ranks are out of step, the spawn stops here"
            )
        time.sleep(0.1)


def several_lengths(rank: int, world_size: int, name: str, lengths: tuple) -> dict:
    """One dynamic compile, called at several sequence lengths: outputs against the whole model."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = MODELS[name]().double()
    backend = ringpass.backend(compiler="aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    errors, compiles = [], []
    for seq_len in lengths:
        inputs = _inputs(name, seq_len, batch=2, seed=seq_len)
        for got, want in zip(compiled(*inputs), model(*inputs)):
            errors.append(rel_err(got.detach(), want.detach()))
        compiles.append(len(backend.reports))
    return {"errors": errors, "compiles": compiles}


def changed_float_attribute(rank: int, world_size: int) -> dict:
    """An SDPA whose scale is a float attribute of the model, compiled with dynamic=True (Dynamo passes the
    float as an input; the ring compiles it as a number): errors against the whole model at two lengths,
    then after the attribute changed, with the number of compiles."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = MaskedAttention(lambda m, s: None).double()
    model.scale = 0.3
    backend = ringpass.backend(compiler="aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    x = [torch.randn(2, n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(n)) for n in (11, 13)]
    result = {"errors": [rel_err(compiled(t), model(t)) for t in x], "compiles": [len(backend.reports)]}
    model.scale = 0.9
    result["changed"] = rel_err(compiled(x[0]), model(x[0]))
    result["compiles"].append(len(backend.reports))
    result["report"] = backend.reports[-1].as_dict()
    return result


def by_registered_name(rank: int, world_size: int) -> dict:
    """``torch.compile(model, backend="ring", options=...)``, found through the entry point, with the
    process group given by name."""
    torch.manual_seed(0)
    model = MODELS["gpt"]().double()
    ids = _inputs("gpt", 10, batch=2, seed=0)[0]
    options = {"compiler": "aot_eager", "layout": "contiguous", "group": dist.group.WORLD.group_name}
    compiled = torch.compile(model, backend="ring", options=options)
    error = rel_err(compiled(ids).detach(), model(ids).detach())
    return {"error": error, "report": ringpass.last_report().as_dict()}


def data_parallel_rings(rank: int, world_size: int, name: str, seq_len: int) -> dict:
    """4 ranks = 2 data-parallel replicas x 2-rank rings: each replica its own batch, the ring on the
    ``cp`` dimension of a DeviceMesh (ranks {0, 1} and {2, 3})."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    return compare(rank, world_size, name, seq_len, {"compiler": "aot_eager"}, None, group=mesh["cp"], seed=rank // 2)


def refusals(rank: int, world_size: int, cases: list[str]) -> dict[str, str]:
    """`refusal` of each case, one after the other in this process."""
    errors = {}
    for case in cases:
        torch._dynamo.reset()
        errors[case] = refusal(rank, world_size, case)
    return errors


def refusal(rank: int, world_size: int, case: str) -> str:
    """Compile a model the backend must refuse; returns the error message."""
    import torch.nn as nn
    import torch.nn.functional as F

    class CumprodAfterAttention(nn.Module):  # (a cumsum passes its chunks' totals: lowering.sequence_mixers)
        def forward(self, x):
            q = x.view(1, x.shape[1], 2, 4).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            return y.cumprod(dim=2)

    class DropoutInAttention(nn.Module):
        def forward(self, x):
            q = x.view(1, x.shape[1], 2, 4).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)

    class DifferentLengths(nn.Module):
        def forward(self, x):
            q = x.view(1, x.shape[1], 2, 4).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q[:, :, :4], q[:, :, :4])

    class TokensMixedByReshape(nn.Module):
        def forward(self, x):
            q = x.view(1, 2, x.shape[1], 4)  # heads cut out of the token axis: not per token
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    class SimilarityMask(nn.Module):
        def forward(self, x):
            q = x.view(1, x.shape[1], 2, 4).transpose(1, 2)
            mask = (x @ x.transpose(1, 2) > 0)[:, None]  # sequence x sequence, from the data
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    class FlexAttention(nn.Module):
        def forward(self, x):
            from torch.nn.attention.flex_attention import flex_attention

            q = x.view(1, x.shape[1], 2, 4).transpose(1, 2)
            return flex_attention(q, q, q, score_mod=lambda score, b, h, q_idx, kv_idx: score * score.abs())

    class FloatMask(nn.Module):
        def forward(self, x):
            q = x.view(1, x.shape[1], 2, 4).transpose(1, 2)
            i = torch.arange(x.shape[1])
            return F.scaled_dot_product_attention(q, q, q, attn_mask=(i[None, :] <= i[:, None]).to(x.dtype))

    class VmapBeforeAttention(nn.Module):
        def forward(self, x):  # vmap over the tokens (as Jamba's scan); with dynamic shapes the probe runs the nest
            x = torch.vmap(lambda token: torch.tanh(token) * token, in_dims=1, out_dims=1)(x)
            q = x.view(1, x.shape[1], 2, 4).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    class AfterAttention(nn.Module):
        def __init__(self, op):
            super().__init__()
            self.op = op

        def forward(self, x):
            q = x.view(1, x.shape[1], 2, 4).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).flatten(2)
            return self.op(y)

    mix = nn.Linear(16, 16)
    after = {
        "token_mixing_linear": lambda y: mix(y.transpose(1, 2)),  # fails at the probe's length
        "sequence_long_weight": lambda y: F.linear(y.transpose(1, 2), torch.ones(16, 16)),  # an [S, S] weight
        "sort": lambda y: torch.sort(y, dim=1).values,
        "max": lambda y: y.max(dim=1).values,
        "conv1d": lambda y: F.conv1d(y.transpose(1, 2), torch.ones(8, 1, 3), padding=1, groups=8),
    }
    model = (
        AfterAttention(after[case])
        if case in after
        else {
            "cumprod": CumprodAfterAttention,
            "dropout": DropoutInAttention,
            "lengths": DifferentLengths,
            "reshape": TokensMixedByReshape,
            "sxs_mask": SimilarityMask,
            "float_mask": FloatMask,
            "flex": FlexAttention,
            "vmap_dynamic": VmapBeforeAttention,
        }[case]()
    )
    logged = _Records()  # what torch's fake tensors log while the backend probes the graph
    logging.getLogger("torch._subclasses.fake_tensor").addHandler(logged)
    try:
        torch.compile(
            model,
            backend=ringpass.backend(compiler="eager"),
            fullgraph=True,
            dynamic=True if case.endswith("dynamic") else None,
        )(torch.randn(1, 16, 8))
    except ringpass.RingpassError as error:  # as ringpass raised it, not wrapped by Dynamo
        left_open = torch._C._functorch.maybe_current_level()  # a vmap level the backend opened and did not close
        return (
            f"{type(error).__name__}: {error}"
            + "".join(f"\nlogged: {r.getMessage()}" for r in logged.records)
            + (f"\nvmap level {left_open} left open" if left_open is not None else "")
        )
    except Exception as error:
        return f"not a ringpass error: {type(error).__name__}: {error}"
    finally:
        logging.getLogger("torch._subclasses.fake_tensor").removeHandler(logged)
    return "no error"


class _PackedBreak(torch.nn.Module):
    """Two attentions masked by packed documents (``doc`` ids compared in the mask) with a projection each and a
    graph break between them: the second graph receives the first's output sharded."""

    def __init__(self, cumsum: bool = False):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.cumsum = cumsum  # a sequence mixer after the break: that graph cannot run in the documents layout

    def forward(self, x, doc):
        pos = torch.arange(x.shape[1])
        mask = ((doc[:, :, None] == doc[:, None, :]) & (pos[None, :] <= pos[:, None]))[:, None]

        def attend(h, project):
            q = project(h).view(h.shape[0], h.shape[1], 2, 4).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).transpose(1, 2).reshape(h.shape)

        h = attend(x, self.first)
        torch._dynamo.graph_break()
        return attend(h, self.second) + (h.cumsum(1) / h.shape[1] if self.cumsum else h)


def documents_across_a_break(rank: int, world_size: int, options: dict, packings: list, cumsum: bool = False) -> dict:
    """`_PackedBreak` (``cumsum``: with a cumsum after the break) compiled with ``options``, called with each of
    ``packings`` (per call, each row's document ids: ``[B][N]``, one N): per call the largest error of the output and
    of every parameter gradient against the model run whole (fp64), the carried output's layout, the KV blocks
    exchanged, the keys read and the ids a ring call copied to the host itself; the graphs' layouts and notes."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = _PackedBreak(cumsum).double()
    backend = ringpass.backend(compiler="aot_eager", **options)
    compiled = torch.compile(model, backend=backend)
    calls = []
    for doc in packings:
        doc = torch.tensor(doc)
        x, weight = (torch.randn(*doc.shape, 8, dtype=torch.float64) for _ in range(2))
        expected = model(x, doc)
        (expected * weight).sum().backward()
        expected_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        model.zero_grad()
        with record_ring_events() as events:
            out = compiled(x, doc)
            (out * weight).sum().backward()
        grads = {k: p.grad for k, p in model.named_parameters()}
        calls.append(
            {
                "output": rel_err(out.full_tensor(), expected),
                "grads": grad_error(grads, expected_grads),
                "carried": out.spec.kind,
                "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
                # the global positions of the keys this rank's forward kernels read: beyond its own where K/V moved
                "keys_read": len({int(p) for e in events if e.kind == "block_forward" for p in e.fields["kv_pos"]}),
                "ids_copied": sum(e.kind == "documents_to_host" for e in events),
            }
        )
        model.zero_grad()
    return {
        "calls": calls,
        "layouts": [report.layout for report in backend.reports],
        "notes": [report.notes for report in backend.reports],
    }


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


class MaskedAttention(torch.nn.Module):
    """One causal SDPA whose mask comes from ``mask_fn(self, S)`` (the cases of `mask_readings`), scaled by
    ``self.scale`` (None: SDPA's default)."""

    def __init__(self, mask_fn):
        super().__init__()
        self.mask_fn, self.scale = mask_fn, None
        self.proj = torch.nn.Linear(8, 24)
        self.register_buffer("modulo", torch.arange(128) % 40)  # equals arange below 40 only
        self.register_buffer("causal", torch.ones(128, 128, dtype=torch.bool).tril())

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        mask = self.mask_fn(self, s)
        return (
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
            .transpose(1, 2)
            .flatten(2)
        )


def _positions(s):
    i = torch.arange(s)
    return i[:, None], i[None, :]


MASK_READINGS = {  # masks a symbolic reading could get wrong: each must match eager at every length
    "modulo_table": lambda m, s: m.modulo[:s][None, :] <= m.modulo[:s][:, None],
    "negative_index": lambda m, s: torch.arange(s)[_positions(s)[1] - 1] <= torch.arange(s)[_positions(s)[0] - 1],
    "add_with_alpha": lambda m, s: torch.add(_positions(s)[1], 1, alpha=3) <= torch.add(_positions(s)[0], 1),
    "large_negative_additive": lambda m, s: ((_positions(s)[1] <= _positions(s)[0]).double() - 1) * 1e300,
    # S x S tensors made from the length alone: with dynamic shapes read at several lengths
    "square_subsequent_mask": lambda m, s: torch.nn.Transformer.generate_square_subsequent_mask(s, dtype=torch.float64),
    "causal_buffer_prefix": lambda m, s: m.causal[:s, :s],
    "window_from_sizes": lambda m, s: (
        torch.ones(s, s, dtype=torch.bool).tril() & ~torch.ones(s, s, dtype=torch.bool).tril(-5)
    ),
    # the length in arithmetic: a window that grows with it, refused with dynamic shapes
    "window_from_length": lambda m, s: (
        torch.ones(s, s, dtype=torch.bool).tril() & ~torch.ones(s, s, dtype=torch.bool).tril(-(s // 3))
    ),
}


def mask_readings(rank: int, world_size: int, lengths: list) -> dict:
    """Per case: the relative error (or the error raised) per length, the first call compiling static and
    the next ones dynamic, and the report of the last graph compiled."""
    results = {}
    for name, mask_fn in MASK_READINGS.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MaskedAttention(mask_fn).double()
        backend = ringpass.backend(compiler="aot_eager")
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        results[name] = {"errors": []}
        for s in lengths:
            x = torch.randn(2, s, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
            try:
                results[name]["errors"].append(rel_err(compiled(x), model(x)))
            except Exception as error:  # Dynamo wraps the backend's refusal
                results[name]["errors"].append(str(error))
        results[name]["report"] = backend.reports[-1].as_dict()
    return results


class FlexModel(torch.nn.Module):
    """Attention by ``flex_attention``: ``case`` "document-alibi" (causal and same-document ``mask_mod``,
    ALiBi ``score_mod`` reading per-head slopes), "softcap" (causal, ``tanh(s / 2) * 2``), "plain" (no
    block mask, no score_mod). ``dense=True`` computes the same attention written out over the whole score
    matrix: the reference (eager flex has no backward on the CPU)."""

    def __init__(self, case: str, seq_len: int):
        super().__init__()
        self.case = case
        self.proj, self.out = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)
        cuts = torch.tensor([seq_len // 3, seq_len - seq_len // 3 - 2, 2])
        self.register_buffer("document", torch.repeat_interleave(torch.arange(3), cuts))
        self.register_buffer("slopes", torch.tensor([0.5, 0.125]))

    def forward(self, x, dense: bool = False):
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = self._dense(q, k, v) if dense else self._flex(q, k, v)
        return self.out(y.transpose(1, 2).flatten(2))

    def _mods(self):
        document, slopes = self.document, self.slopes

        def causal_documents(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (document[q_idx] == document[kv_idx])

        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        def softcap(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / 2.0) * 2.0

        return (causal_documents, alibi) if self.case == "document-alibi" else (causal, softcap)

    def _flex(self, q, k, v):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if self.case == "plain":
            return flex_attention(q, k, v)
        mask_mod, score_mod = self._mods()
        block_mask = create_block_mask(mask_mod, None, None, q.shape[2], q.shape[2], device=q.device)
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)

    def _dense(self, q, k, v):
        scores = q @ k.transpose(-1, -2) / 2.0  # head dim 4
        if self.case == "plain":
            return torch.softmax(scores, -1) @ v
        pos = torch.arange(q.shape[2])
        if self.case == "document-alibi":
            scores = scores + self.slopes[:, None, None] * (pos[None, :] - pos[:, None])
            visible = (pos[None, :] <= pos[:, None]) & (self.document[:, None] == self.document[None, :])
        else:
            scores = torch.tanh(scores / 2.0) * 2.0
            visible = pos[None, :] <= pos[:, None]
        return torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v


def flex_training_step(rank: int, world_size: int, case: str, seq_len: int) -> dict:
    """Output and every parameter gradient of the flex model compiled with the ring vs the same attention
    written out densely, run whole."""
    import torch.nn.attention.flex_attention as flex

    flex._validate_device = lambda *tensors: None  # its "no backward on the CPU" check: the ring replaces flex
    torch.manual_seed(0)
    model = FlexModel(case, seq_len)
    x = torch.randn(2, seq_len, 8, generator=torch.Generator().manual_seed(1))
    expected = model(x, dense=True)
    (expected**2).mean().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    backend = ringpass.backend(compiler="aot_eager")
    with record_ring_events() as events:
        got = torch.compile(model, backend=backend, fullgraph=True)(x)
        (got**2).mean().backward()
    return {
        "out": rel_err(got, expected),
        "grads": grad_error({n: p.grad for n, p in model.named_parameters()}, expected_grads),
        "report": backend.reports[-1].as_dict(),
        "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
    }


def strategy_cases(rank: int, world_size: int, cases: list) -> dict:
    """``compare`` for each (case id, model name, options) at 64 tokens, with what moved between the ranks: ring
    exchanges, Ulysses all-to-alls, all-gather waits; and the RingpassWarnings raised."""
    import warnings

    from lowering.errors import RingpassWarning

    results = {}
    for case_id, name, options in cases:
        with record_ring_events() as events, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = compare(rank, world_size, name, 64, options, dynamic=False)
        result["moved"] = sorted(
            {
                e.kind if e.kind != "span" else e.fields["message"]
                for e in events
                if e.kind in ("exchange", "heads_exchange")
                or (e.kind == "span" and "all-gather" in e.fields["message"])
            }
        )
        result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RingpassWarning)]
        results[case_id] = result
    return results
