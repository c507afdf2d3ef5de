"""A differential fuzzer for trained values inside an attention's score or mask program.

A trained value read through a program whose index depends on positions (T5's and MPNet's relative-position
buckets, a hand-written clamped-distance table, ALiBi slopes that train) is the kind of value whose gradient a
sharded run can get wrong while every output stays exact: the ring evaluates the program per tile on global
positions and pulls each tile's score gradient back through it (`lowering.program_grads`). This module draws
such models and everything around them with hypothesis and compares, in one process per rank, the ring's loss,
output and **every** gradient, by name, with the same model run whole:

- the family: Hugging Face T5 encoders (SDPA or eager; UMT5: a table in every layer), MPNet (eager), and a
  hand-written attention (`ScoreProgramNet`) with a bucket table over the clamped query-key distance, learned
  slopes, or both, causal or bidirectional, SDPA with the bias as its float mask or written out; and two forms
  the ring does not compute, which must be refused, never answered (a learned sink logit, a trained soft-cap);
- sizes: buckets 8-64, a maximal distance below, around or above the length, heads, lengths not a multiple
  of 2P (and shorter than P), the mask tile (many tiles per block, or one), the ring size P (2-4);
- the run: two training steps (the second call after an SGD step on both models: a trained value read as a
  constant would go stale), layout, padding (none, right, left), ``masks`` (lift or materialize), ``outputs``,
  static or dynamic shapes (``dynamic=True``, or a recompile for the second call's length), fp64 (or fp32), a
  loss outside the graph (a fixed random
  projection of the output: a loss such as ``out.pow(2).mean()`` sends the output's own direction back through
  a final RMS norm, whose Jacobian maps it to almost nothing, so fp32 compares rounding with rounding) or inside
  it (token cross-entropy with ignored labels);
- the front end: ``backend="ring"``, ``ringpass.convert`` then ``save`` / ``load``, or ``inputs="per_rank"``
  (each rank its own batch; the reference is a data-parallel job: each rank's output on its batch, the mean of
  the ranks' gradients).

`run_case` runs one case on a rank and returns its errors; `check` says what is wrong with a rank's result;
``tests/models/test_score_program_fuzz.py`` draws the cases.
"""

from __future__ import annotations

import copy
import math
import os
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

import lowering.masks
import lowering.ring
import ringpass
from lowering import record_ring_events
from lowering.errors import NotSupportedError

VOCAB = 29
BATCH = 2
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}
# what a gradient that is zero in exact arithmetic is measured against, times the largest gradient's norm: its
# rounding, not its size, is what two runs compare (fp64: at 1e-6 it alone reaches 1e-10, as in
# `reference.grad_error`; fp32: the q and k gradients of two tokens, one of them padding, cancel to ~1e-5)
FLOOR = {"float64": 1e-4, "float32": 1e-2}
REFUSED = ("sink", "trained_softcap")  # forms the kernels do not compute: refused at `find_attention`
HF = ("t5", "umt5", "mpnet")
FRONT_ENDS = ("backend", "convert", "per_rank")
DYNAMIC = {"backend": [False, True, "auto"], "convert": [False, True], "per_rank": [False]}


# --- the cases ----------------------------------------------------------------------------------------------


@st.composite
def cases(draw, front_ends=FRONT_ENDS, world_sizes=(2, 3, 4), families=None) -> dict:
    """One model, its sizes, the ring it runs on and how it is called."""
    family = draw(st.sampled_from(families or ("t5", "umt5", "mpnet", "hand", "hand", "hand", *REFUSED)))
    world_size = draw(st.sampled_from(world_sizes))
    seq_len = draw(st.one_of(st.integers(2, 2 * world_size + 1), st.integers(2 * world_size, 40)))
    front_end = draw(st.sampled_from(front_ends))
    causal = family not in HF and draw(st.booleans())
    case = dict(
        family=family,
        world_size=world_size,
        seq_len=seq_len,
        heads=draw(st.integers(1, 4)),
        head_dim=draw(st.sampled_from([4, 8])),
        causal=causal,
        padding=draw(st.sampled_from(["none", "right", "left"])),
        layout=draw(st.sampled_from(["auto", "zigzag", "contiguous"])),
        masks=draw(st.sampled_from(["lift", "materialize"])),
        # True: compiled with symbolic lengths; "auto": static, Dynamo recompiles dynamic at the second length
        dynamic=draw(st.sampled_from(DYNAMIC[front_end])),
        second_len=draw(st.integers(2, 40)),
        outputs=draw(st.sampled_from(["gathered"] if front_end == "convert" else ["auto", "gathered"])),
        dtype=draw(st.sampled_from(["float64", "float64", "float64", "float32"])),
        loss=draw(st.sampled_from(["projection", "cross_entropy"])),
        front_end=front_end,
        mask_tile=draw(st.sampled_from([4, 8, 256])),  # many tiles per block, or one
        seed=draw(st.integers(0, 2**16)),
    )
    if family in ("t5", "umt5"):
        buckets = draw(st.integers(8, 64))
        # T5's buckets: half per direction, half of those exact; the rest log-spaced up to max_distance
        smallest = buckets // 4 + 1
        case.update(buckets=buckets, max_distance=_distance(draw, seq_len, smallest))
        case["implementation"] = draw(st.sampled_from(["sdpa", "eager"]))
    elif family == "mpnet":
        case.update(buckets=draw(st.integers(32, 64)), max_distance=128)  # MPNet reads 32 buckets up to 128
    elif family == "hand":
        case.update(
            buckets=draw(st.integers(8, 64)),
            max_distance=_distance(draw, seq_len, 1),
            table=draw(st.booleans()),
            slopes=draw(st.booleans()),
            spelling=draw(st.sampled_from(["sdpa", "written"])),
            tied=draw(st.booleans()),  # the output head is the embedding (tied weights)
        )
        if not (case["table"] or case["slopes"]):
            case["table"] = True
    return case


def _distance(draw, seq_len: int, smallest: int) -> int:
    """A maximal distance below, around or above the length."""
    below = max(smallest, seq_len // 2)
    return draw(
        st.sampled_from(
            [max(smallest, d) for d in (below, seq_len - 1, seq_len, seq_len + 1, 2 * seq_len + 3, smallest)]
        )
    )


def describe(case: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in case.items())


# --- the models ---------------------------------------------------------------------------------------------


class ScoreProgramNet(nn.Module):
    """Hand-written attention whose scores add trained values read by position: ``table[bucket(k - q)]`` per
    head (the distance clamped at ``max_distance``, then cut into ``buckets``) and ``slopes[h] · |k - q|``
    (ALiBi with slopes that train); causal or bidirectional, a key padding mask ``keep [B, N]`` added as
    ``finfo.min`` with the causal mask (as Hugging Face adds its masks); SDPA with the whole bias as its float
    mask, or written out.
    ``family="sink"``: a learned per-head logit joins each row's softmax (attention sinks); ``"trained_softcap"``:
    the scores soft-capped by a trained cap. Two layers share the bias, as T5's do; ``tied``: the output head's
    weight is the embedding's."""

    def __init__(self, case: dict, dim_per_head: int):
        super().__init__()
        self.case = case
        heads, dim = case["heads"], case["heads"] * dim_per_head
        self.embed, self.head = nn.Embedding(VOCAB, dim), nn.Linear(dim, VOCAB)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(2))
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.norm = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2))
        self.table = nn.Embedding(case.get("buckets", 8), heads) if case.get("table") else None
        self.slopes = nn.Parameter(torch.linspace(-0.6, -0.05, heads)) if case.get("slopes") else None
        self.sink = nn.Parameter(torch.randn(heads)) if case["family"] == "sink" else None
        self.cap = nn.Parameter(torch.tensor(1.7)) if case["family"] == "trained_softcap" else None
        if case.get("tied"):
            self.head.weight = self.embed.weight

    def bias(self, n: int, keep, dtype) -> torch.Tensor:
        """``[B or 1, H or 1, N, N]``: the trained terms, then causal and padding as ``finfo.min``."""
        idx = torch.arange(n, device=self.embed.weight.device)
        distance = idx[None, :] - idx[:, None]
        bias = torch.zeros((), dtype=dtype, device=idx.device)
        if self.table is not None:
            reach, buckets = self.case["max_distance"], self.case["buckets"]
            bucket = (distance.clamp(-reach, reach) + reach) * (buckets - 1) // (2 * reach)
            bias = bias + self.table(bucket).permute(2, 0, 1).unsqueeze(0)
        if self.slopes is not None:
            bias = bias + (self.slopes[:, None, None] * distance.abs().to(dtype)).unsqueeze(0)
        hidden = (distance > 0) if self.case["causal"] else torch.zeros_like(distance, dtype=torch.bool)
        if keep is not None:
            hidden = hidden | ~keep[:, None, None, :]
        return bias + hidden.to(dtype) * torch.finfo(dtype).min  # hidden once, as Hugging Face builds its masks

    def forward(self, ids, keep=None, labels=None):
        b, n = ids.shape
        x = self.embed(ids)
        bias = self.bias(n, keep, x.dtype)
        for qkv, proj, norm in zip(self.qkv, self.proj, self.norm):
            q, k, v = qkv(norm(x)).view(b, n, 3, self.case["heads"], -1).permute(2, 0, 3, 1, 4)
            x = x + proj(self.attend(q, k, v, bias).transpose(1, 2).reshape(b, n, -1))
        logits = self.head(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def attend(self, q, k, v, bias):
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if self.cap is not None:
            return torch.softmax(torch.tanh(scores / self.cap) * self.cap + bias, dim=-1) @ v
        if self.sink is not None:
            scores = scores + bias
            sinks = self.sink.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
            return torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1] @ v
        if self.case["spelling"] == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.expand(q.size(0), *bias.shape[1:]))
        return torch.softmax(scores + bias, dim=-1) @ v


def build(case: dict) -> nn.Module:
    """The case's model, the same on every rank (seeded), in its dtype."""
    import transformers

    torch.manual_seed(case["seed"])
    family, heads, d = case["family"], case["heads"], case["head_dim"]
    token_labels = case["loss"] == "cross_entropy"
    if family in ("t5", "umt5"):
        config_class = transformers.T5Config if family == "t5" else transformers.UMT5Config
        config = config_class(
            vocab_size=VOCAB,
            d_model=heads * d,
            d_kv=d,
            d_ff=2 * heads * d,
            num_layers=2,
            num_heads=heads,
            num_labels=VOCAB,
            relative_attention_num_buckets=case["buckets"],
            relative_attention_max_distance=case["max_distance"],
            dropout_rate=0.0,
            classifier_dropout=0.0,
            attn_implementation=case["implementation"],
        )
        names = {"t5": ("T5EncoderModel", "T5ForTokenClassification")}
        names["umt5"] = ("UMT5EncoderModel", "UMT5ForTokenClassification")
        model = getattr(transformers, names[family][token_labels])(config)
    elif family == "mpnet":
        config = transformers.MPNetConfig(
            vocab_size=VOCAB,
            hidden_size=heads * d,
            num_hidden_layers=2,
            num_attention_heads=heads,
            intermediate_size=2 * heads * d,
            max_position_embeddings=128,
            relative_attention_num_buckets=case["buckets"],
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=1,
        )
        model = (transformers.MPNetForMaskedLM if token_labels else transformers.MPNetModel)(config)
    else:
        model = ScoreProgramNet(case, d)
    return model.to(getattr(torch, case["dtype"]))


def inputs(case: dict, seq_len: int, stream: int = 0) -> dict:
    """The model's keyword arguments for one call (``stream``: another batch, for another rank or call)."""
    gen = torch.Generator().manual_seed(case["seed"] * 7 + stream)
    ids = torch.randint(2, VOCAB, (BATCH, seq_len), generator=gen)
    keep = None
    if case["padding"] != "none":
        keep = torch.ones(BATCH, seq_len, dtype=torch.bool)
        hidden = max(1, seq_len // 3)  # row 1 only: a batch of one padded and one whole sequence
        keep[1, slice(-hidden, None) if case["padding"] == "right" else slice(0, hidden)] = False
    kwargs = {"input_ids" if case["family"] in HF else "ids": ids}
    if keep is not None:
        kwargs["attention_mask" if case["family"] in HF else "keep"] = keep.long() if case["family"] in HF else keep
    if case["loss"] == "cross_entropy":
        labels = torch.randint(0, VOCAB, (BATCH, seq_len), generator=gen)
        labels[torch.rand(BATCH, seq_len, generator=gen) < 0.2] = -100
        if keep is not None:
            labels[~keep] = -100
        kwargs["labels"] = labels
    return kwargs


def objective(case: dict, output, stream: int):
    """(loss, output tensor or None): the model's own loss, or a fixed random projection of its output."""
    if case["loss"] == "cross_entropy":
        loss = output if isinstance(output, torch.Tensor) else output.loss
        return loss, None
    out = output if isinstance(output, torch.Tensor) else output[0]
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    gen = torch.Generator().manual_seed(case["seed"] * 11 + stream)
    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    return (out * weights).sum(), out


# --- one case on every rank ----------------------------------------------------------------------------------


def run_case(rank: int, world_size: int, case: dict, folder: str) -> dict:
    """The case's ring run against its model run whole, two training steps (a second call after an SGD step on
    both, at a second length where the case is dynamic): the largest relative errors of the loss, the output
    and each gradient (by name), the ring's KV exchanges; or what it raised."""
    model = build(case)
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    tiles = lowering.masks.MASK_TILE, lowering.ring.WORK_TILE_MIN
    lowering.masks.MASK_TILE = case["mask_tile"]
    lowering.ring.WORK_TILE_MIN = min(tiles[1], case["mask_tile"])  # work tiles are multiples of the mask tile
    stream_of = rank if case["front_end"] == "per_rank" else 0
    found = {"loss": 0.0, "output": 0.0, "grads": {}}
    try:
        with record_ring_events() as events:
            runs, trained = _front_end(model, case, world_size, rank, folder)
            for call, n in enumerate(_lengths(case)):
                want_loss, want_out = _reference_step(reference, case, n, 10 * call, world_size)[stream_of]
                stream = stream_of + 10 * call
                loss, out = objective(case, runs(**inputs(case, n, stream)), stream)
                loss.backward()
                found["loss"] = max(found["loss"], _relative(loss.detach(), want_loss))
                if want_out is not None:
                    found["output"] = max(found["output"], _relative(out.detach(), want_out))
                _merge(found["grads"], _grad_errors(_grads(trained), _grads(reference), FLOOR[case["dtype"]]))
                _sgd_step(trained, reference)
    except Exception as error:
        return {
            "raised": type(error).__name__,
            "refusal": isinstance(error, NotSupportedError),
            "message": f"{type(error).__name__}: {error}"[:2000],
            "traceback": traceback.format_exc()[-3000:],
        }
    finally:
        lowering.masks.MASK_TILE, lowering.ring.WORK_TILE_MIN = tiles
    return {"raised": None, **found, "exchanges": sum(e.kind == "exchange" for e in events)}


def _lengths(case: dict) -> list[int]:
    return [case["seq_len"], case["second_len"] if case["dynamic"] else case["seq_len"]]


def _reference_step(reference, case: dict, seq_len: int, call: int, world_size: int) -> list:
    """(loss, output) of each stream's batch; the gradients of their mean over the streams (a data-parallel
    job's, for ``per_rank``: one stream per rank; else the one batch every rank passes)."""
    streams = range(world_size) if case["front_end"] == "per_rank" else range(1)
    found = []
    for stream in streams:
        loss, out = objective(case, reference(**inputs(case, seq_len, stream + call)), stream + call)
        (loss / len(streams)).backward()
        found.append((loss.detach(), None if out is None else out.detach()))
    return found


def _grads(module: nn.Module) -> dict:
    return {name: p.grad for name, p in module.named_parameters() if p.grad is not None}


@torch.no_grad()
def _sgd_step(trained: nn.Module, reference: nn.Module) -> None:
    """One SGD step on both models with one learning rate, the reference's: it moves the reference's weights by
    1% of their norm (a fixed rate would throw some drawn models far enough that fp32 compares rounding amplified
    by saturated softmaxes; a rate per parameter would blow a gradient that is zero in exact arithmetic, its
    rounding, up to 1% of that parameter). A rate computed per model would differ between the two wherever such a
    gradient is exactly zero in one run and rounding (1e-17) in the other, which leaves a parameter out of one
    model's norms: the second call then compares two different models (two identical tokens give every score a
    zero gradient; the case `SHORT_PADDED_TABLE` was that)."""
    # (a parameter only an unused output reads has a zero gradient under torch.compile, None in eager: left out)
    moved = [p for p in reference.parameters() if p.grad is not None and p.grad.count_nonzero()]
    weights = math.sqrt(sum(p.norm().item() ** 2 for p in moved))
    grads = math.sqrt(sum(p.grad.norm().item() ** 2 for p in moved))
    rate = 0.01 * weights / max(grads, 1e-30)
    for module in (trained, reference):
        for p in module.parameters():
            if p.grad is not None:
                p.sub_(p.grad * rate)
            p.grad = None


def _merge(worst: dict, errors: dict) -> None:
    """The worst error per name over the calls ("missing" / "unexpected" over any number)."""
    for name, error in errors.items():
        before = worst.get(name, 0.0)
        worst[name] = error if isinstance(error, str) or (not isinstance(before, str) and error > before) else before


def _front_end(model, case: dict, world_size: int, rank: int, folder: str):
    """(what to call, the module whose parameters it trains)."""
    options = {"layout": case["layout"], "masks": case["masks"]}
    if case["front_end"] == "convert":
        example = inputs(case, case["seq_len"])
        converted = ringpass.convert(model, example, world_size=world_size, dynamic=case["dynamic"], **options)
        path = os.path.join(folder, f"case-{rank}.pt2")
        converted.save(path)
        loaded = ringpass.load(path)
        return loaded, loaded.model
    extra = {"inputs": "per_rank"} if case["front_end"] == "per_rank" else {}
    backend = ringpass.backend(compiler="aot_eager", report="off", outputs=case["outputs"], **options, **extra)
    dynamic = {True: True, False: None, "auto": None}[case["dynamic"]]  # None: Dynamo recompiles dynamic
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic), model


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def _grad_errors(grads: dict, expected: dict, floor: float) -> dict:
    """name -> relative error (norm-wise) of each gradient; "missing" / "unexpected" where only one run has a
    nonzero one (a compiled graph gives zeros, not None, to a parameter that only an unused output reads, as
    ``torch.compile`` does with any backend). A gradient that is zero in exact arithmetic (a key bias under
    softmax, a query whose keys are all one token) is measured against ``floor`` times the largest gradient's norm
    instead of its own (`FLOOR`)."""
    floor *= max((g.double().norm().item() for g in expected.values()), default=0.0)
    errors = {}
    for name in sorted(set(grads) | set(expected)):
        if name not in grads or name not in expected:
            only = grads.get(name, expected.get(name))
            if only.count_nonzero():
                errors[name] = "missing" if name not in grads else "unexpected"
            continue
        got, want = grads[name].double(), expected[name].double()
        errors[name] = ((got - want).norm() / max(want.norm().item(), floor, 1e-300)).item()
    return errors


def refusal_expected(case: dict) -> str | None:
    """What a refusal of the case must say, where the case must be refused: the forms the kernels do not
    compute; a dynamic compile whose first call has batch size = length (one symbol for both: docs/backend.md)."""
    if case["family"] in REFUSED:
        return "softmax whose probabilities multiply values"
    if case["dynamic"] is True and case["seq_len"] == BATCH:
        return "duck sizing"
    return None


def check(case: dict, result: dict) -> list[str]:
    """What is wrong with one rank's result of a case (empty: nothing). A loaded dynamic conversion may refuse a
    second length shorter than the one it was converted at (a rank's share or chunk of 1 token is specialised
    when torch.export traces it at save: docs/convert.md), with an error saying so; never a longer one."""
    if (
        result["raised"] == "InvalidInputError"
        and case["front_end"] == "convert"
        and case["dynamic"]
        and case["second_len"] < case["seq_len"]
        and "shape condition torch.export traced it under" in result["message"]
    ):
        return []
    expected = refusal_expected(case)
    if expected is not None:
        if result["raised"] is None:
            return [f"answered instead of refused: loss {result['loss']:.1e}, grads {result['grads']}"]
        return [] if result["refusal"] and expected in result["message"] else [result["message"]]
    if result["raised"] is not None:
        return [result["message"], result["traceback"]]
    bound = TOLERANCE[getattr(torch, case["dtype"])]
    problems = [f"{what} off by {result[what]:.2e}" for what in ("loss", "output") if not result[what] <= bound]
    problems += [
        f"gradient of {name}: {error if isinstance(error, str) else f'off by {error:.2e}'}"
        for name, error in result["grads"].items()
        if isinstance(error, str) or not error <= bound
    ]
    if result["exchanges"] == 0:
        problems.append("the ring did not run (no KV exchange)")
    return problems
