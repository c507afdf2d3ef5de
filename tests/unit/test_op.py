"""ring_attention in one process (a ring of one, no process group): the custom op and bad input."""

import pytest
import torch
from reference import attention_fp64, masked_attention_fp64, rel_err

from lowering import InvalidInputError, Layout, NotSupportedError, RingpassError, record_ring_events, ring_attention
from lowering.masks import DOCUMENTS, register_mask
from lowering.ring_args import RingArgs


def _qkv(n, heads=4, kv_heads=2, dim=8, dtype=torch.float64):
    torch.manual_seed(0)
    return [torch.randn(2, h, n, dim, dtype=dtype) for h in (heads, kv_heads, kv_heads)]


def test_ring_of_one_equals_sdpa_with_lse_and_grads():
    q, k, v = (t.requires_grad_() for t in _qkv(12))
    out, lse = ring_attention(q, k, v, layout=Layout("zigzag", 1, 12), is_causal=True, return_lse=True)
    ref_out, ref_lse = attention_fp64(q, k, v, is_causal=True)
    assert rel_err(out, ref_out) < 1e-12 and rel_err(lse, ref_lse) < 1e-12
    grads = torch.autograd.grad((out * out).sum() + lse.sum(), (q, k, v))
    expected = torch.autograd.grad((ref_out * ref_out).sum() + ref_lse.sum(), (q, k, v))
    for got, want in zip(grads, expected):
        assert rel_err(got, want) < 1e-11


def _head_bias(q_pos, kv_pos, per_head):
    """A bias program reading one input: a per-head multiple of the query-key distance."""
    return per_head[:, None, None] * (q_pos[:, None] - kv_pos[None, :]).abs()


@pytest.mark.parametrize("scores", [False, True], ids=["plain", "score-modifiers"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "non-contiguous"])
def test_opcheck(contiguous, scores):
    n = 10
    if contiguous:
        q, k, v = _qkv(n)
    else:
        q, k, v = (torch.randn(2, n, h, 8, dtype=torch.float64).transpose(1, 2) for h in (4, 2, 2))
    args = RingArgs("zigzag", 1, n, True, 0.3, "")
    if scores:
        slopes, per_head = [0.5, 0.25, 0.125, 0.0625], [torch.rand(4, dtype=torch.float64)]
        args = args._replace(softcap=0.8, alibi_slopes=slopes, bias_id=register_mask(_head_bias), bias_inputs=per_head)
        args = args._replace(fully_masked="uniform")
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *args.op_args())
    torch.library.opcheck(torch.ops.ringpass.ring_attention.default, args)


def test_errors_are_one_family():
    assert issubclass(InvalidInputError, RingpassError) and issubclass(NotSupportedError, RingpassError)


layout = Layout("contiguous", 1, 6)
q, k, v = _qkv(6)
BAD_INPUTS = {
    "3-D q": (dict(q=q[0]), InvalidInputError, r"q must be 4-D"),
    "integer q": (dict(q=q.long()), InvalidInputError, r"q has dtype torch.int64; .*floating dtype"),
    "mixed dtypes": (dict(k=k.float()), InvalidInputError, r"share one dtype"),
    "k on another device": (dict(k=k.to("meta")), InvalidInputError, r"on one device.*\.to\(\)"),
    "k and v differ": (dict(v=v[:, :1]), InvalidInputError, r"k and v must have the same shape"),
    "v wider than k": (
        dict(v=torch.randn(2, 2, 6, 12, dtype=torch.float64)),
        NotSupportedError,
        r"values wider than keys",
    ),
    "batch differs": (dict(k=k[:1], v=v[:1]), InvalidInputError, r"agree in batch"),
    "Hq not a multiple of Hkv": (
        dict(k=torch.randn(2, 3, 6, 8, dtype=torch.float64), v=torch.randn(2, 3, 6, 8, dtype=torch.float64)),
        InvalidInputError,
        r"4 heads, k/v have 3.*multiple",
    ),
    "full sequence passed as a shard": (
        dict(layout=Layout("contiguous", 1, 5)),
        InvalidInputError,
        r"q has 6 tokens on this rank but .* gives every rank 5; .*layout.shard",
    ),
    "layout for 2 ranks without a process group": (
        dict(layout=Layout("zigzag", 2, 12)),
        InvalidInputError,
        r"spans 2 ranks but no process group is initialised",
    ),
    "not a layout": (dict(layout="zigzag"), InvalidInputError, r"layout must be a lowering.Layout"),
    "empty head dim": (
        dict(q=q[..., :0], k=k[..., :0], v=v[..., :0]),
        InvalidInputError,
        r"must not have an empty dimension",
    ),
    "scale not a number": (dict(scale="0.5"), InvalidInputError, r"scale must be a Python number"),
    "group without a process group": (
        dict(group=object()),
        InvalidInputError,
        r"not initialised; call init_process_group",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_refused_with_what_to_do(name):
    change, error, message = BAD_INPUTS[name]
    kwargs = dict(q=q, k=k, v=v, layout=layout) | change
    with pytest.raises(error, match=message):
        ring_attention(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), **kwargs)


def test_double_backward_is_refused_clearly():
    q, k, v = (t.requires_grad_() for t in _qkv(6))
    out = ring_attention(q, k, v, layout=Layout("zigzag", 1, 6), is_causal=True)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(NotSupportedError, match="double backward"):
        dq.sum().backward()


def test_values_narrower_than_keys_are_padded_and_cut():
    """MLA: a value head dim smaller than the key head dim (the values travel padded with zeros)."""
    q, k = (t.requires_grad_() for t in _qkv(12)[:2])
    v = torch.randn(2, 2, 12, 5, dtype=torch.float64, requires_grad=True)
    out = ring_attention(q, k, v, layout=Layout("zigzag", 1, 12), is_causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.shape == (2, 4, 12, 5) and rel_err(out, expected) < 1e-12
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))):
        assert rel_err(got, want) < 1e-11


@pytest.mark.parametrize("host_copy", [False, True], ids=["ids", "ids-and-host-copy"])
def test_the_documents_mask_plans_from_the_host_copy_a_graph_passes(host_copy):
    """A compiled graph passes the documents mask's ids and their host copy (`rewrite_attention`): the op then copies
    nothing itself (on a GPU each copy is a sync); given the ids alone it copies them once in the forward and once in
    the backward. Exact against the dense fp64 reference either way."""
    n = 11
    q, k, v = (t.requires_grad_() for t in _qkv(n))
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3])
    inputs = [ids, ids[None].clone()] if host_copy else [ids]
    args = RingArgs("contiguous", 1, n, True, 0.3, "", mask_id=DOCUMENTS, mask_inputs=inputs)
    with record_ring_events() as events:
        out, _ = torch.ops.ringpass.ring_attention.default(q, k, v, *args.op_args())
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    visible = (ids[:, None] == ids[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    expected = masked_attention_fp64(q, k, v, visible, 0.3)
    assert rel_err(out, expected) < 1e-12
    for got, want in zip(grads, torch.autograd.grad(expected.square().sum(), (q, k, v))):
        assert rel_err(got, want) < 1e-11
    assert sum(e.kind == "documents_to_host" for e in events) == (0 if host_copy else 2)


def test_the_documents_mask_takes_the_ids_and_at_most_their_host_copy():
    q, k, v = _qkv(4)
    ids = torch.tensor([0, 0, 1, 1])
    args = RingArgs("zigzag", 1, 4, True, 0.3, "", mask_id=DOCUMENTS, mask_inputs=[ids, ids, ids])
    with pytest.raises(InvalidInputError, match="reads the ids and at most their host copy after them"):
        torch.ops.ringpass.ring_attention.default(q, k, v, *args.op_args())
