"""Workers of tests/distributed/test_eager_outputs.py: the eager code users write on what a ring model returns.

`LINES` are lines of eager code on logits ``[B, N, V]`` (metrics, losses, checks, conversion, saving), each run on a
`SequenceSharded` value and on the whole tensor; `lines` reports, per line, the difference, whether it all-gathered
the sequence and whether it warned. `model_lines` runs some of them on the logits of a compiled `models.Llama`.
`lonely` runs a line on rank 0 alone; `apart` runs two different lines on two ranks.
"""

from __future__ import annotations

import io
import pickle
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from models import Llama
from reference import grad_error, rel_err

import ringpass
from lowering import record_ring_events
from ringpass import ImplicitGatherWarning, NeedsWholeSequence, SequenceSharded

B, N, V = 2, 13, 7  # 13 tokens: zigzag over 2 or 3 ranks leaves padding slots

_LABELS = torch.Generator().manual_seed(1)
LABELS = torch.randint(0, V, (B, N), generator=_LABELS)
LABELS[0, 3] = -100


def _saved(t):
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    return torch.load(buffer)


# name -> (line, needs the whole sequence). Each takes the logits (and the whole logits, for comparisons).
LINES = {
    # reductions over other dims, and ops along them: each rank's tokens
    "argmax accuracy": (lambda t, w: (t.argmax(-1) == LABELS).float().mean(), False),
    "softmax max": (lambda t, w: t.softmax(-1).max(-1).values.mean(), False),
    "entropy": (lambda t, w: -(t.softmax(-1) * t.log_softmax(-1)).sum(-1).mean(), False),
    "var(-1)": (lambda t, w: t.var(-1), False),
    "std(-1, unbiased=False)": (lambda t, w: t.std(-1, unbiased=False), False),
    "sort(-1)": (lambda t, w: t.sort(-1), False),
    "argsort(-1)": (lambda t, w: t.argsort(-1, descending=True), False),
    "topk(3, -1)": (lambda t, w: t.topk(3, -1), False),
    "norm(dim=-1)": (lambda t, w: t.norm(dim=-1), False),
    "logsumexp(-1)": (lambda t, w: torch.logsumexp(t, -1), False),
    "max(-1)": (lambda t, w: t.max(-1), False),
    "cumsum(-1)": (lambda t, w: t.cumsum(-1), False),
    "flip(-1)": (lambda t, w: t.flip(-1), False),
    "roll(1, -1)": (lambda t, w: t.roll(1, -1), False),
    "gather log-probs": (lambda t, w: F.log_softmax(t, -1).gather(-1, LABELS.clamp(min=0)[..., None]), False),
    "isnan().any(-1)": (lambda t, w: t.isnan().any(-1), False),
    "median(-1)": (lambda t, w: t.median(-1), False),
    "stack": (lambda t, w: torch.stack([t, t * 2], 1), False),
    "iterate the batch": (lambda t, w: [row.sum(-1) for row in t], False),
    "cross_entropy [B, V, N]": (lambda t, w: F.cross_entropy(t.transpose(1, 2), LABELS), False),
    "cross_entropy [B, V, N] none": (lambda t, w: F.cross_entropy(t.transpose(1, 2), LABELS, reduction="none"), False),
    "cross_entropy [B*N, V]": (lambda t, w: F.cross_entropy(t.reshape(-1, V), LABELS.reshape(-1)), False),
    "shifted cross_entropy": (lambda t, w: F.cross_entropy(t[:, :-1].reshape(-1, V), LABELS[:, 1:].reshape(-1)), False),
    "one_hot mse": (lambda t, w: F.mse_loss(t.softmax(-1), F.one_hot(LABELS.clamp(min=0), V).to(t.dtype)), False),
    # whole reductions: each rank's part combined across the ring
    "norm()": (lambda t, w: t.norm(), False),
    "vector_norm(1)": (lambda t, w: torch.linalg.vector_norm(t, 1), False),
    "norm(inf)": (lambda t, w: t.norm(float("inf")), False),
    "norm(dim=1)": (lambda t, w: t.norm(dim=1), False),
    "std()": (lambda t, w: t.std(), False),
    "var(1)": (lambda t, w: t.var(1), False),
    "var_mean()": (lambda t, w: torch.var_mean(t), False),
    "std_mean(1)": (lambda t, w: torch.std_mean(t, 1), False),
    "logsumexp(1)": (lambda t, w: torch.logsumexp(t, 1), False),
    "isnan().any()": (lambda t, w: t.isnan().any(), False),
    "isfinite().all()": (lambda t, w: t.isfinite().all(), False),
    "(t > 0).any(1)": (lambda t, w: (t > 0).any(1), False),
    "count_nonzero()": (lambda t, w: (t > 0).count_nonzero(), False),
    "prod(1)": (lambda t, w: (1 + t.tanh() / 9).prod(1), False),
    "nansum()": (lambda t, w: t.nansum(), False),
    "allclose": (lambda t, w: torch.allclose(t, w), False),
    "allclose (off)": (lambda t, w: torch.allclose(t, w + 1e-3), False),
    "equal": (lambda t, w: torch.equal(t, w), False),
    "mse_loss": (lambda t, w: F.mse_loss(t, w * 0.5), False),
    "smooth_l1_loss": (lambda t, w: F.smooth_l1_loss(t, w * 0.5), False),
    "bce with logits": (lambda t, w: F.binary_cross_entropy_with_logits(t, (w * 0.5).sigmoid()), False),
    "max abs diff .item()": (lambda t, w: (t - w * 0.9).abs().max().item(), False),
    "sum().item()": (lambda t, w: t.sum().item(), False),
    "assert_close": (lambda t, w: torch.testing.assert_close(t, w) is None, False),
    # the whole sequence: gathered (checked) and warned
    "numpy()": (lambda t, w: t.detach().numpy(), True),
    "float().cpu().numpy()": (lambda t, w: t.detach().float().cpu().numpy(), True),
    "np.asarray": (lambda t, w: np.asarray(t.detach()), True),
    "tolist()": (lambda t, w: t.tolist(), True),
    "argmax(-1).tolist()": (lambda t, w: t.argmax(-1).tolist(), True),
    "flip(1)": (lambda t, w: t.flip(1), True),
    "roll(1, 1)": (lambda t, w: t.roll(1, 1), True),
    "cumsum(1)": (lambda t, w: t.cumsum(1), True),
    "sort(1)": (lambda t, w: t.sort(1), True),
    "softmax(1)": (lambda t, w: t.softmax(1), True),
    "median()": (lambda t, w: t.median(), True),
    "quantile": (lambda t, w: t.float().quantile(0.25), True),
    "masked select": (lambda t, w: t[t > 0], True),
    "nonzero": (lambda t, w: (t > 1).nonzero(), True),
    "unique": (lambda t, w: t.argmax(-1).unique(), True),
    "torch.save": (lambda t, w: _saved(t), True),
    "pickle": (lambda t, w: pickle.loads(pickle.dumps(t.detach())), True),
}

# lines whose gradient reaches the logits, with the gradient compared too
DIFFERENTIABLE = (
    "entropy",
    "var(-1)",
    "topk(3, -1)",
    "logsumexp(-1)",
    "gather log-probs",
    "stack",
    "cross_entropy [B, V, N]",
    "shifted cross_entropy",
    "one_hot mse",
    "norm()",
    "norm(dim=1)",
    "std()",
    "var(1)",
    "std_mean(1)",
    "logsumexp(1)",
    "prod(1)",
    "mse_loss",
    "smooth_l1_loss",
    "bce with logits",
    "flip(1)",
    "cumsum(1)",
    "sort(1)",
    "softmax(1)",
)


def _as_tensor(value):
    """A result as one fp64 tensor for comparing (tuples and lists flattened, numbers and arrays converted)."""
    if isinstance(value, SequenceSharded):
        return value.full_tensor().detach().double()
    if isinstance(value, (tuple, list)):
        parts = [_as_tensor(v).reshape(-1) for v in value]
        return torch.cat(parts) if parts else torch.zeros(0)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value).double()
    if isinstance(value, torch.Tensor):
        return value.detach().double()
    return torch.tensor(float(value), dtype=torch.float64)


def _plain(value) -> bool:
    """No `SequenceSharded` left in what the line returned (as after a gather)."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return not isinstance(value, SequenceSharded)


def _run(name, line, t, w):
    with warnings.catch_warnings(record=True) as caught, record_ring_events() as events:
        warnings.simplefilter("always")
        value = line(t, w)
    gathers = [e for e in events if e.kind == "all_gather"]
    warned = [str(c.message) for c in caught if issubclass(c.category, ImplicitGatherWarning)]
    return value, gathers, warned


def lines(rank: int, world_size: int, dtype: str = "float64") -> dict:
    torch.manual_seed(0)
    whole = torch.randn(B, N, V, dtype=getattr(torch, dtype)) * 2
    results = {}
    for name, (line, _) in LINES.items():
        leaf = whole.clone().requires_grad_(name in DIFFERENTIABLE)
        value, gathers, warned = _run(name, line, SequenceSharded.distribute(leaf, 1), whole)
        expected_leaf = whole.clone().requires_grad_(name in DIFFERENTIABLE)
        expected = line(expected_leaf, whole)
        got, want = _as_tensor(value), _as_tensor(expected)
        result = {
            "error": rel_err(got, want) if got.shape == want.shape and got.numel() else float(got.shape != want.shape),
            "shape": [list(got.shape), list(want.shape)],
            "plain": _plain(value),
            "gathers": len(gathers),
            "warned": warned,
        }
        if name in DIFFERENTIABLE:
            flat = _flat(expected)
            probe = torch.randn(flat.shape, dtype=flat.dtype, generator=torch.Generator().manual_seed(2))
            (_flat(value) * probe).sum().backward()
            (flat * probe).sum().backward()
            result["grad"] = grad_error({"logits": leaf.grad}, {"logits": expected_leaf.grad})
        again = _run(name, line, SequenceSharded.distribute(whole, 1), whole)  # the same line: warned once
        result["warned again"] = again[2]
        results[name] = result
    return results


def _flat(value):
    """The floating-point parts of a result as one flat tensor, through autograd (a sharded one gathered)."""
    if isinstance(value, SequenceSharded):
        return value.full_tensor().reshape(-1)
    if isinstance(value, (tuple, list)):
        return torch.cat([_flat(v) for v in value if v.is_floating_point()])
    return value.reshape(-1)


def in_place(rank: int, world_size: int) -> dict:
    """In-place ops: a plain tensor written with a sharded operand, a sharded value written along its sequence."""
    whole = torch.randn(B, N, V, dtype=torch.float64)
    plain = torch.ones(B, N, V, dtype=torch.float64)
    plain.add_(SequenceSharded.distribute(whole, 1))  # the plain tensor itself changes, whole
    carried = SequenceSharded.distribute(whole.clone(), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImplicitGatherWarning)
        carried.cumsum_(1)
    return {"plain": rel_err(plain, whole + 1), "carried": rel_err(carried.full_tensor(), whole.cumsum(1))}


def model_lines(rank: int, world_size: int) -> dict:
    """A compiled Llama's logits (`SequenceSharded` by default) under the eager code of a training script."""
    torch.manual_seed(0)
    model = Llama(vocab=V).double()
    ids = torch.randint(0, V, (B, N))
    expected = model(ids)
    compiled = torch.compile(model, backend="ring")
    with record_ring_events() as events, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = compiled(ids)
        loss = F.cross_entropy(logits.transpose(1, 2), LABELS)
        loss.backward()
        got = {
            "type": type(logits).__name__,
            "loss": rel_err(loss, F.cross_entropy(expected.transpose(1, 2), LABELS)),
            "allclose": torch.allclose(logits, expected.detach(), rtol=1e-9, atol=1e-12),
            "numpy": rel_err(torch.from_numpy(logits.detach().numpy()), expected),
            "saved": _saved(logits.detach()),
            "perplexity": rel_err(loss.exp(), F.cross_entropy(expected.transpose(1, 2), LABELS).exp()),
        }
    got["saved"] = [type(got["saved"]).__name__, rel_err(got["saved"], expected)]
    got["kv_exchanges"] = sum(e.kind == "exchange" and e.fields["payload"] == "kv" for e in events)
    got["warned"] = sorted({str(c.message).split(" on a ")[0] for c in caught if c.category is ImplicitGatherWarning})
    return got


def lonely(rank: int, world_size: int, then: str) -> dict:
    """Rank 0 runs ``logits.tolist()`` alone; the others go on (``then``: "step", a training step of the compiled
    model; "barrier", a plain `dist.barrier` outside ringpass). Rank 0 catches its error and goes on too."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Llama(vocab=V).double()
    ids = torch.randint(0, V, (B, N))
    expected = F.cross_entropy(model(ids).transpose(1, 2), LABELS).detach()
    compiled = torch.compile(model, backend=ringpass.backend(timeout=3.0))
    logits = compiled(ids)
    result = {}
    if rank == 0:
        started = time.monotonic()
        try:
            logits.tolist()
            result["error"] = ""
        except NeedsWholeSequence as error:
            result["error"] = str(error)
        result["seconds"] = time.monotonic() - started
    if then == "barrier":
        dist.barrier()
    loss = F.cross_entropy(compiled(ids).transpose(1, 2), LABELS)
    loss.backward()
    result["loss"] = rel_err(loss, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImplicitGatherWarning)
        result["together"] = rel_err(torch.tensor(logits.tolist()), torch.tensor(logits.full_tensor().tolist()))
    return result


def apart(rank: int, world_size: int) -> dict:
    """Rank 0 and rank 1 each gather at a line of their own: both are told, neither hangs."""
    x = SequenceSharded.distribute(torch.randn(B, N, V, dtype=torch.float64), 1)
    started = time.monotonic()
    try:
        if rank == 0:
            x.flip(1)
        else:
            x.roll(2, 1)
        return {"error": "", "seconds": time.monotonic() - started}
    except NeedsWholeSequence as error:
        return {"error": str(error), "seconds": time.monotonic() - started}


# a drawn case (`tests/distributed/test_eager_outputs.py::cases`): one op with its dims and options on a value of
# a drawn shape, sharded along a drawn dim in a drawn layout


def _drawn_op(case: dict, t, w):
    """The op ``case`` names, on ``t`` (the value; ``w``: the whole tensor, the same on every rank)."""
    op, dims, keepdim, dim = case["op"], case["dims"], case["keepdim"], case["dim"]
    dims = None if dims is None else tuple(dims)
    if op in ("sum", "mean", "amax", "amin", "nansum", "logsumexp"):
        return getattr(torch, op)(t, dim=dims if dims is not None else tuple(range(t.dim())), keepdim=keepdim)
    if op in ("any", "all"):
        return getattr(torch, op)(t > 0.3, dim=dims, keepdim=keepdim) if dims else getattr(torch, op)(t > -3)
    if op == "count_nonzero":
        return torch.count_nonzero(t > 0, dim=dims)
    if op == "prod":
        bounded = 1 + t.tanh() / 9
        return bounded.prod() if dims is None else bounded.prod(dim, keepdim=keepdim)
    if op in ("max", "min"):
        return getattr(t, op)() if dims is None else getattr(t, op)(dim, keepdim=keepdim)
    if op == "norm":
        return torch.linalg.vector_norm(t, case["ord"], dim=dims, keepdim=keepdim)
    if op in ("var", "std", "var_mean", "std_mean"):
        return getattr(torch, op)(t, dim=dims, correction=case["correction"], keepdim=keepdim)
    if op in ("allclose", "equal"):
        other = w.clone()
        other.view(-1)[case["seed"] % other.numel()] += case["off"]
        return torch.allclose(t, other) if op == "allclose" else torch.equal(t, other)
    if op in ("mse_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss", "binary_cross_entropy_with_logits"):
        target = (w * 0.5).sigmoid() if op == "binary_cross_entropy_with_logits" else (w * 0.5).sign()
        return getattr(F, op)(t, target, reduction=case["reduction"])
    if op in ("sort", "cumsum", "flip", "softmax", "argmax", "median"):
        return getattr(t, op)([dim] if op == "flip" else dim)
    if op == "topk":
        return t.topk(min(2, t.size(dim)), dim)
    if op == "roll":
        return t.roll(1, dim)
    raise ValueError(op)


def drawn(rank: int, world_size: int, case: dict) -> dict:
    """``case``'s op on the sharded value and on the whole tensor: the result's and the gradient's differences."""
    generator = torch.Generator().manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    whole = (torch.randn(case["shape"], generator=generator, dtype=torch.float64) * 2).to(dtype)
    leaf, expected_leaf = whole.clone().requires_grad_(), whole.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImplicitGatherWarning)
        value = _drawn_op(case, SequenceSharded.distribute(leaf, case["seq_dim"], layout=case["layout"]), whole)
    expected = _drawn_op(case, expected_leaf, whole)
    got, want = _as_tensor(value), _as_tensor(expected)
    result = {"shapes": [list(got.shape), list(want.shape)], "value": _difference(got, want, case["dtype"], whole)}
    flat = _flat(expected) if torch.is_tensor(expected) or isinstance(expected, (tuple, list)) else None
    if flat is not None and flat.requires_grad:
        probe = torch.randn(flat.shape, generator=generator, dtype=torch.float64).to(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ImplicitGatherWarning)
            (_flat(value) * probe).sum().backward()
        (flat * probe).sum().backward()
        grads = [torch.zeros_like(whole) if x.grad is None else x.grad for x in (leaf, expected_leaf)]
        result["grad"] = _difference(*grads, case["dtype"], probe)
    return result


def _difference(got, want, dtype: str, operand: torch.Tensor) -> str:
    """'' when ``got`` equals ``want`` within the dtype's tolerance (nan and inf where ``want`` has them), else why.
    The absolute tolerance scales with the larger of ``want`` and the ``operand`` it was computed from: a sum that
    cancels to near zero carries the rounding of its terms, not of its result."""
    tolerance = 1e-12 if dtype == "float64" else 1e-5
    if got.shape != want.shape:
        return f"shape {list(got.shape)} != {list(want.shape)}"
    scale = max((t[t.isfinite()].abs().max().item() for t in (want, operand) if t.isfinite().any()), default=1.0)
    try:
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * max(scale, 1e-30), equal_nan=True)
    except AssertionError as error:
        return str(error)[:600]
    return ""
