"""What each rank runs in the composition tests: the ring under FSDP2 / DDP / tensor parallel / Ulysses on a
DeviceMesh, one training step against the unsharded model on the whole global batch in one process (fp32)."""

from __future__ import annotations

from functools import partial

import hf_workers
import models
import torch
import torch.distributed as dist
import torch.nn.functional as F
from reference import grad_error, rel_err

import ringpass
from lowering import record_ring_events

SEQ_LEN, ROWS = 12, 2  # tokens per sequence; rows of the batch on each data-parallel replica


def mesh_2d(dp: int, cp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))


def global_batch(dp: int, vocab: int = 61) -> torch.Tensor:
    return torch.randint(0, vocab, (dp * ROWS, SEQ_LEN), generator=torch.Generator().manual_seed(1))


def wrapped_step(
    rank: int,
    world_size: int,
    wrapper: str,
    dp: int,
    grads: str = "auto",
    family: str = "llama",
    options: dict | None = None,
) -> dict:
    """One step of ``family`` (tests.models' Llama with its loss, or ``hf_llama``) wrapped as ``wrapper`` says,
    the ring on the mesh's ``cp`` dimension (with the backend's ``options`` besides), each data-parallel replica its
    rows of the global batch:

    - ``fsdp2``: ``fully_shard`` on every block and the root over the data x ring ranks flattened
      (one rank pair: the ring's own ranks); ``fsdp2_root``: the root only; ``hsdp``: every block and the root
      on the 2-D mesh (replicated over dp, sharded over cp);
    - ``ddp``: DDP over the data x ring ranks flattened; ``ddp_dp``: DDP over the data-parallel ranks only.

    Returns the loss and gradient errors against the unsharded model on the global batch, the ring's KV
    exchanges, ringpass's all-reduces in the backward and the collectives CommDebugMode saw there."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.nn.parallel import DistributedDataParallel

    mesh = mesh_2d(dp, world_size // dp)
    everyone = mesh["dp", "cp"]._flatten("dp_cp")
    model, reference = _model(family), _model(family)
    ids = global_batch(dp)
    expected = _loss(reference, ids)
    expected.backward()
    expected_grads = {n: p.grad for n, p in reference.named_parameters()}

    replica = mesh.get_local_rank("dp")
    mine = ids[replica * ROWS : (replica + 1) * ROWS]
    torch._dynamo.reset()
    units = 0  # FSDP2 units: one reduce-scatter each in the backward
    if wrapper in ("fsdp2", "fsdp2_root", "hsdp"):
        over = mesh if wrapper == "hsdp" else everyone  # HSDP: replicated over dp, sharded over cp
        if wrapper != "fsdp2_root":
            for block in _blocks(model):
                fully_shard(block, mesh=over)
                units += 1
        wrapped = fully_shard(model, mesh=over)
        units += 1
    elif wrapper in ("ddp", "ddp_dp"):
        group = everyone.get_group() if wrapper == "ddp" else mesh["dp"].get_group()
        wrapped = DistributedDataParallel(model, process_group=group)
    else:
        raise ValueError(wrapper)
    backend = ringpass.backend(
        compiler="aot_eager", report="off", group=mesh["cp"], grads=grads, unsharded="warn", **(options or {})
    )
    compiled = torch.compile(wrapped, backend=backend)
    with record_ring_events() as forward:
        loss = _loss(compiled, mine)
    with record_ring_events() as backward, CommDebugMode() as comm:
        loss.backward()
    grads_now = {
        n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()
    }
    loss_all = loss.detach().clone()
    dist.all_reduce(loss_all, group=mesh["dp"].get_group())  # the global batch's loss: the replicas' mean
    return {
        "loss": rel_err(loss_all / dp, expected.detach()),
        "grads": grad_error(grads_now, expected_grads),
        "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in forward),
        "ringpass_all_reduces": sum(e.kind == "all_reduce" for e in backward),
        "backward_all_reduce_shapes": [list(e.fields["shape"]) for e in backward if e.kind == "all_reduce"],
        "head_shape": list((model.lm_head if _is_hf(model) else model.body.head).weight.shape),
        "collectives": {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()},
        "fsdp_units": units,
        "gradients": [r.gradients for r in backend.reports if r.gradients],
        "why": [r.gradients_why for r in backend.reports if r.gradients_why],
        "summaries": [r.summary() for r in backend.reports],
        "mixers": [m.strategy for r in backend.reports for m in r.mixers],
        "summary_gathers": sum(e.kind == "mixer_exchange" for e in forward),
    }


def refused(rank: int, world_size: int, wrapper: str, grads: str = "auto") -> str:
    """The error a combination that would give wrong gradients raises."""
    try:
        wrapped_step(rank, world_size, wrapper, 1, grads)
    except ringpass.RingpassError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def runs(rank: int, world_size: int, calls: dict) -> dict:
    """Several of this module's functions in one process: ``calls`` maps a case's name to (function, args); the
    result maps it to what the function returned."""
    return {case: globals()[name](rank, world_size, *args) for case, (name, args) in calls.items()}


def _model(family: str):
    torch.manual_seed(0)
    if family.startswith("hf_"):  # hf_llama, hf_lfm2 (a hybrid: convolution layers between attention layers)
        return hf_workers.build(family[3:])
    return models.WithLoss(models.Llama())


def _blocks(model):
    return model.model.layers if hasattr(model, "model") else model.body.blocks


def _loss(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False) if _is_hf(model) else model(ids, ids)
    return out.loss if hasattr(out, "loss") else out[0]


def _is_hf(model) -> bool:
    inner = getattr(model, "_orig_mod", model)
    inner = getattr(inner, "module", inner)
    return hasattr(inner, "config")


def ulysses_by_hand(rank: int, world_size: int, cases: list) -> list:
    """`lowering.ulysses_attention` on a (ring, ulysses) mesh of ``world_size`` ranks against fp64 attention of the
    whole sequence: per case (seq_len, q heads, kv heads, causal, kind), the output and q/k/v gradients' errors."""
    from reference import attention_fp64
    from torch.distributed.device_mesh import init_device_mesh

    from lowering import Layout, ulysses_attention

    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("ring", "ulysses"))
    results = []
    for seq_len, heads, kv_heads, causal, kind in cases:
        generator = torch.Generator().manual_seed(seq_len + heads + kv_heads)
        q, k, v = (
            torch.randn(2, h, seq_len, 8, generator=generator, dtype=torch.float64, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)
        )
        expected = attention_fp64(q, k, v, is_causal=causal)[0]
        dout = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
        expected_grads = torch.autograd.grad(expected, (q, k, v), dout)
        layout = Layout(kind, world_size, seq_len)
        mine = [layout.shard(t.detach(), 2, rank).requires_grad_() for t in (q, k, v)]
        with record_ring_events() as events:
            out = ulysses_attention(
                *mine,
                layout=layout,
                ring_group=mesh["ring"].get_group(),
                ulysses_group=mesh["ulysses"].get_group(),
                is_causal=causal,
            )
            grads = torch.autograd.grad(out, mine, layout.shard(dout, 2, rank))
        if not results:  # the all-to-all ops' schemas, fakes (strides included) and autograd against their real calls
            args = (
                kind,
                world_size,
                seq_len,
                2,
                mesh["ulysses"].get_group().group_name,
                mesh["ring"].get_group().group_name,
            )
            torch.library.opcheck(
                torch.ops.ringpass.ulysses_heads_to_tokens.default, (mine[0].detach().requires_grad_(), *args)
            )
            exchanged = torch.ops.ringpass.ulysses_heads_to_tokens(mine[0].detach(), *args).requires_grad_()
            torch.library.opcheck(torch.ops.ringpass.ulysses_tokens_to_heads.default, (exchanged, *args))
            kv_share = torch.ops.ringpass.ulysses_heads_to_tokens(mine[1].detach(), *args).requires_grad_()
            torch.library.opcheck(
                torch.ops.ringpass.ulysses_tokens_to_heads.default, (kv_share, *args)
            )  # one head each
        results.append(
            {
                "out": rel_err(out, layout.shard(expected.detach(), 2, rank)),
                "grads": max(rel_err(g, layout.shard(e, 2, rank)) for g, e in zip(grads, expected_grads)),
                "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
                "all_to_alls": sum(e.kind == "heads_exchange" for e in events),
            }
        )
    return results


def ulysses_step(rank: int, world_size: int, family: str, how: str, compiler: str = "aot_eager") -> dict:
    """One training step of ``family`` compiled with Ulysses x ring, U = 2: ``how`` = "mesh" (group = a 2-D
    (ring, ulysses) DeviceMesh) or "option" (options={"ulysses": 2} over the default group)."""
    torch._dynamo.reset()
    model, reference = _model(family), _model(family)
    ids = global_batch(1)
    expected = _loss(reference, ids)
    expected.backward()
    if how == "mesh":
        options = {"group": mesh_2d(world_size // 2, 2)}
    else:
        options = {"ulysses": 2}
    backend = ringpass.backend(compiler=compiler, report="off", **options)
    with record_ring_events() as events:
        loss = _loss(torch.compile(model, backend=backend, fullgraph=True), ids)
    with record_ring_events() as backward:
        loss.backward()
    events += backward
    return {
        "ringpass_all_reduces": sum(e.kind == "all_reduce" for e in backward),
        "parameters": len(list(model.parameters())),
        "loss": rel_err(loss.detach(), expected.detach()),
        "grads": grad_error(
            {n: p.grad for n, p in model.named_parameters()}, {n: p.grad for n, p in reference.named_parameters()}
        ),
        "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
        "all_to_alls": sum(e.kind == "heads_exchange" for e in events),
        "report": backend.reports[-1].as_dict(),
    }


def tensor_parallel_step(rank: int, world_size: int) -> dict:
    """A Hugging Face Llama with attention and MLP sharded over the mesh's ``tp`` dimension (DTensor,
    ``parallelize_module``: q/k/v and gate/up column-wise, o and down row-wise), the ring over ``cp``: one
    training step against the unsharded model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("cp", "tp"))
    model, reference = _model("hf_llama"), _model("hf_llama")
    ids = global_batch(1)
    expected = _loss(reference, ids)
    expected.backward()
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    backend = ringpass.backend(compiler="aot_eager", report="off", group=mesh["cp"])
    with record_ring_events() as events:
        loss = _loss(torch.compile(model, backend=backend), ids)
    with record_ring_events() as backward:
        loss.backward()
    events += backward
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    return {
        "ringpass_all_reduces": sum(e.kind == "all_reduce" for e in backward),
        "parameters": len(list(model.parameters())),
        "loss": rel_err(loss.detach(), expected.detach()),
        "grads": grad_error(grads, {n: p.grad for n, p in reference.named_parameters()}),
        "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
        "kv_bytes": sorted({e.fields["bytes"] for e in events if e.kind == "exchange" and e.fields["payload"] == "kv"}),
        "reports": [r.as_dict() for r in backend.reports],
    }


def ulysses_hf_modes(rank: int, world_size: int, cases: list) -> dict:
    """A Hugging Face Llama with Ulysses x ring (U = 2) per batch case of `hf_workers.batch` (left padding, packed
    documents), compiled once with dynamic shapes and run at two lengths: loss, logits and gradients at the
    first, logits at the second."""
    results = {}
    for case in cases:
        torch._dynamo.reset()
        model = hf_workers.build("llama")
        kwargs = hf_workers.batch(case, SEQ_LEN + 1)
        expected = model(**kwargs)
        expected.loss.backward()
        expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        backend = ringpass.backend(compiler="aot_eager", report="off", ulysses=2)
        compiled = torch.compile(model, backend=backend, dynamic=True)
        with record_ring_events() as events:
            got = compiled(**kwargs)
            got.loss.backward()
        first_compiles = len(backend.reports)
        longer = hf_workers.batch(case, SEQ_LEN + 7)
        results[case] = {
            "loss": rel_err(got.loss, expected.loss),
            "logits": rel_err(got.logits, expected.logits),
            "grads": grad_error({n: p.grad for n, p in model.named_parameters()}, expected_grads),
            "longer": rel_err(compiled(**longer).logits, model(**longer).logits),
            "all_to_alls": sum(e.kind == "heads_exchange" for e in events),
            "first_compiles": first_compiles,
            "later_compiles": len(backend.reports) - first_compiles,
        }
    return results


def per_rank_step(rank: int, world_size: int, wrapper: str, rows: int, packed: bool = False) -> dict:
    """``inputs="per_rank"``: each rank passes its own ``rows`` sequences (the ranks' label counts differ), an HF
    Llama with its loss (``packed``: each row packed from documents as TRL packs, position ids restarting at each,
    every rank's rows packed their own way); ``wrapper``: ``none``, ``ddp`` (over every rank), ``ddp_dp`` (over the
    data-parallel ranks of a (dp 2, cp P/2) mesh, the ring over ``cp``; on 4 ranks the ring is over ``cp`` for every
    wrapper) or ``fsdp2_root`` (``fully_shard`` of the root over the 4 ranks flattened).
    The reference is a data-parallel job in one process: each rank's loss and logits on its own batch, the
    gradient the mean over all ranks of each rank's (with no wrapper on a mesh: over the ring's ranks).
    (Batches of different lengths: `per_rank_lengths`; activations across graph boundaries: `per_rank_blocks`.)"""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model, reference = hf_workers.build("llama"), hf_workers.build("llama")
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 61, (rows, SEQ_LEN), generator=g) for _ in range(world_size)]
    labels = [ids.clone() for ids in batches]
    labels[1][:, :7] = -100
    positions = [
        torch.cat([torch.arange(n) for n in ((7, 3, 2), (3, 9), (12,), (1, 11))[(source + row) % 4]])
        for source in range(world_size)
        for row in range(rows)
    ]
    packing = [
        {"position_ids": torch.stack(positions[s * rows : (s + 1) * rows])} if packed else {} for s in range(world_size)
    ]
    mesh = mesh_2d(world_size // 2, 2) if world_size > 2 else None
    # the ranks whose objectives the gradient averages: all (a wrapper averages across the rings), else the ring's
    averaged = mesh["cp"].mesh.tolist() if mesh is not None and wrapper == "none" else list(range(world_size))
    expected = []
    for source, (ids, lab) in enumerate(zip(batches, labels)):
        out = reference(input_ids=ids, labels=lab, use_cache=False, **packing[source])
        if source in averaged:
            (out.loss / len(averaged)).backward()
        expected.append(out)
    torch._dynamo.reset()
    ring = mesh["cp"] if mesh is not None else None
    if wrapper == "none":
        wrapped = model
    elif wrapper == "fsdp2_root":
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
    else:  # buckets of 1 kB: Dynamo's DDPOptimizer would cut the graph (it opens with a bucket as small)
        over = mesh["dp"].get_group() if wrapper == "ddp_dp" else None
        wrapped = DistributedDataParallel(model, process_group=over, bucket_cap_mb=0.001)
        dist._DEFAULT_FIRST_BUCKET_BYTES = min(dist._DEFAULT_FIRST_BUCKET_BYTES, wrapped.bucket_bytes_cap)
    backend = ringpass.backend(compiler="aot_eager", report="off", inputs="per_rank", group=ring)
    compiled = torch.compile(wrapped, backend=backend)
    with record_ring_events() as events:
        out = compiled(input_ids=batches[rank], labels=labels[rank], use_cache=False, **packing[rank])
    out.loss.backward()
    grads = {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for n, p in model.named_parameters()}
    return {
        "loss": rel_err(out.loss.detach(), expected[rank].loss.detach()),
        "logits": rel_err(out.logits.detach(), expected[rank].logits.detach()),
        "grads": grad_error(grads, {n: p.grad for n, p in reference.named_parameters()}),
        "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
        "summaries": [r.summary() for r in backend.reports],
        "gradients": [r.gradients for r in backend.reports if r.gradients],
    }


def per_rank_lengths(rank: int, world_size: int) -> dict:
    """``inputs="per_rank"`` compiled with ``dynamic=True`` under DDP, each rank's batch of its own length and
    size (a data-parallel loader padding each batch to its longest row: one row right-padded, masked, its labels
    -100): each rank's loss and logits its own batch's, DDP's mean gradient; then a graph compiled for one length
    (``dynamic=False``) and one whose shape guards take only one rank's length, given batches of different lengths:
    the errors every rank raises."""
    from torch.nn.parallel import DistributedDataParallel

    model, reference = hf_workers.build("llama"), hf_workers.build("llama")
    g = torch.Generator().manual_seed(7)
    batches = []
    for source in range(world_size):
        rows, length = 2 + source % 2, SEQ_LEN - 3 * source
        ids = torch.randint(0, 61, (rows, length), generator=g)
        mask = torch.ones_like(ids)
        mask[-1, length - 2 - source :] = 0
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    expected = []
    for batch in batches:
        out = reference(**batch, use_cache=False)
        (out.loss / world_size).backward()
        expected.append(out)
    torch._dynamo.reset()
    backend = ringpass.backend(compiler="aot_eager", report="off", inputs="per_rank")
    compiled = torch.compile(DistributedDataParallel(model), backend=backend, dynamic=True)
    with record_ring_events() as events:
        out = compiled(**batches[rank], use_cache=False)
    out.loss.backward()
    errors = {}
    for case, program in {
        "fixed_length": torch.compile(model, backend=backend, dynamic=False),
        "branch_on_length": torch.compile(_attend_by_length, backend=backend, dynamic=True),
    }.items():
        try:
            program(**batches[rank], use_cache=False)
            errors[case] = "no error"
        except ringpass.RingpassError as error:
            errors[case] = str(error)
    return {
        "loss": rel_err(out.loss.detach(), expected[rank].loss.detach()),
        "logits": rel_err(out.logits.detach(), expected[rank].logits.detach()),
        "grads": grad_error(
            {n: p.grad for n, p in model.named_parameters()}, {n: p.grad for n, p in reference.named_parameters()}
        ),
        "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
        **errors,
    }


def per_rank_tail(rank: int, world_size: int, wrapper: str) -> dict:
    """``inputs="per_rank"``, a model whose loss shifts the hidden states by one after the last attention
    (`models.ShiftedHead`, its head tied to the embedding), each rank its own 2 rows (the ranks' label counts
    differ); ``wrapper``: ``none`` (every rank ends with the mean gradient) or ``ddp``. The shift, the head and the
    loss run once on each rank's own batch (`ringpass.passes.split_tail`); the reference is a one-process
    data-parallel job. Then a token shift between two attentions: still refused, on every rank."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model, reference = models.ShiftedHead(models.Llama()), models.ShiftedHead(models.Llama())
    batches, labels, losses = _data_parallel_reference(model, reference, world_size, 9, reference)
    backend = ringpass.backend(compiler="aot_eager", report="off", inputs="per_rank")
    compiled = torch.compile(model if wrapper == "none" else DistributedDataParallel(model), backend=backend)
    with record_ring_events() as events:
        loss = compiled(batches[rank], labels[rank])
    loss.backward()
    try:
        torch.compile(_shift_between_attentions, backend=backend)(torch.randn(1, 2, SEQ_LEN, 8))
        refused = "no error"
    except ringpass.RingpassError as error:
        refused = str(error)
    return {
        "loss": rel_err(loss.detach(), losses[rank].detach()),
        "grads": grad_error(
            {n: p.grad for n, p in model.named_parameters() if p.requires_grad},
            {n: p.grad for n, p in reference.named_parameters() if p.requires_grad},
        ),
        "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
        "summary": backend.reports[0].summary(),
        "refused": refused,
    }


def per_rank_blocks(rank: int, world_size: int, how: str) -> dict:
    """``inputs="per_rank"`` across graph boundaries, fp64: a Llama (`models.Llama`) whose blocks are compiled one by
    one under DDP (``ddp_blocks``) or under FSDP2 on every block and the root (as torchtitan: ``fsdp2_blocks``), and
    a Hugging Face Llama under FSDP2 on every decoder layer and the root, compiled whole (FSDP2's hooks cut it into
    a graph per block), rank 1's rows right-padded with their mask (``hf_fsdp2_padded``: the mask the first graph
    builds crosses to the blocks as its description). Each rank its own 2 rows, the ranks' label counts differ. The
    hidden states reach every ring graph as this rank's own batch's and are sent by tokens; the embedding, the norm,
    the head and the loss run on the own batch. Reference: a one-process data-parallel job (each rank's loss on its
    own batch, the gradient of their mean). ``ddp_blocks`` then attends over an eager activation of shape
    [rows, 1, N, D] without a wrapper: its output and its gradient (this rank's own objective's) as unsharded."""
    from torch.nn.parallel import DistributedDataParallel

    hf = how == "hf_fsdp2_padded"
    model, reference = (_model("hf_llama"), _model("hf_llama")) if hf else (models.Llama(), models.Llama())
    model, reference = model.double(), reference.double()

    def loss_of(net, ids, lab):
        if hf:  # the ignored labels are rank 1's padding
            return net(input_ids=ids, attention_mask=(lab != -100).long(), labels=lab, use_cache=False).loss
        return F.cross_entropy(net(ids).flatten(0, 1), lab.flatten())

    batches, labels, losses = _data_parallel_reference(model, reference, world_size, 11, partial(loss_of, reference))
    backend = ringpass.backend(compiler="aot_eager", report="off", inputs="per_rank")
    blocks = model.model.layers if hf else model.blocks
    if how == "ddp_blocks":
        for block in blocks:
            block.compile(backend=backend)
        run = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
            if not hf:
                block.compile(backend=backend)
        run = fully_shard(model, mesh=mesh)
        if hf:
            run.compile(backend=backend)
    with record_ring_events() as events:
        loss = loss_of(run, batches[rank], labels[rank])
        loss.backward()
    result = {
        "loss": rel_err(loss.detach(), losses[rank].detach()),
        "grads": grad_error(
            {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for n, p in model.named_parameters()},
            {n: p.grad for n, p in reference.named_parameters()},
        ),
        "kv_exchanges": sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events),
        "summaries": [r.summary() for r in backend.reports],
    }
    if how == "ddp_blocks":
        hidden = reference.embed(batches[rank])[:, None].detach().requires_grad_()
        attend = torch.compile(lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True), backend=backend)
        expected = F.scaled_dot_product_attention(hidden, hidden, hidden, is_causal=True)
        (expected_grad,) = torch.autograd.grad(expected.pow(2).sum(), hidden)
        out = attend(hidden)
        out.pow(2).sum().backward()
        result["activation"] = (rel_err(out.detach(), expected.detach()), rel_err(hidden.grad, expected_grad))
    return result


def _data_parallel_reference(model, reference, world_size: int, seed: int, loss_of) -> tuple[list, list, list]:
    """Each rank's own 2 rows of token ids and their labels (rank 1's last 5 labels ignored, so the ranks' label
    counts differ), and the one-process data-parallel job on them: ``reference`` (given ``model``'s weights) gets the
    gradient of the mean of ``loss_of(ids, labels)`` over the ranks' batches; returns the batches, labels and losses."""
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, 61, (2, SEQ_LEN), generator=g) for _ in range(world_size)]
    labels = [ids.clone() for ids in batches]
    labels[1][:, -5:] = -100
    losses = []
    for ids, lab in zip(batches, labels):
        losses.append(loss_of(ids, lab))
        (losses[-1] / world_size).backward()
    torch._dynamo.reset()
    return batches, labels, losses


def _shift_between_attentions(x):
    y = torch.roll(F.scaled_dot_product_attention(x, x, x, is_causal=True), 1, dims=2)
    return F.scaled_dot_product_attention(y, y, y, is_causal=True)


def _attend_by_length(input_ids, attention_mask, labels, use_cache):
    """Causal attention over codes of the token ids, coded one way for long sequences and another for short: a graph
    that holds the length symbolic but only for lengths on one side of 10 (its shape guards)."""
    x = torch.sin(input_ids[:, None, :, None] * torch.arange(1.0, 9.0))
    if input_ids.size(1) > 10:
        x = x.flip(-1)
    return F.scaled_dot_product_attention(x, x, x, is_causal=True)
