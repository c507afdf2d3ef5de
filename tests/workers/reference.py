"""Independent references for the tests: unsharded attention in fp64, and the chunked scans' recurrences token by
token, written without lowering's code."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_fp64(q, k, v, *, is_causal: bool, scale: float | None = None):
    """(out, lse) of full-sequence attention in fp64: out from SDPA, lse from the score matrix."""
    q, k, v = (t.double() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True)
    return out, lse_fp64(q, k, is_causal=is_causal, scale=scale)


def lse_fp64(q, k, *, is_causal: bool, scale: float | None = None, q_pos=None, kv_pos=None):
    """log-sum-exp of each query row's visible scores (positions default to 0..n-1)."""
    q, k = q.double(), k.double()
    scale = q.size(-1) ** -0.5 if scale is None else scale
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    q_pos = torch.arange(q.size(2)) if q_pos is None else q_pos
    kv_pos = torch.arange(k.size(2)) if kv_pos is None else kv_pos
    rows = []
    for start in range(0, q.size(2), 512):  # 512 query rows at a time bounds the score matrix's memory
        scores = q[:, :, start : start + 512] @ k.transpose(-1, -2) * scale
        if is_causal:
            scores = scores.masked_fill(kv_pos[None, :] > q_pos[start : start + 512, None], float("-inf"))
        rows.append(torch.logsumexp(scores, dim=-1))
    return torch.cat(rows, dim=-1)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


def masked_attention_fp64(
    q, k, v, visible: torch.Tensor, scale: float | None = None, *, softcap=None, bias=None, fully_masked: str = "zero"
) -> torch.Tensor:
    """Attention in fp64 under a dense boolean ``visible`` mask (broadcast to [B, Hq, N, N]). ``softcap``
    caps the scaled scores (``c·tanh(s/c)``), then a dense ``bias`` is added. Rows with no visible key:
    ``fully_masked="zero"`` gives them 0 (SDPA's bool-mask convention); ``"uniform"`` hides keys as eager
    attention does, adding ``finfo.min`` to their scores; ``"uniform_values"`` replaces their scores with it
    (``masked_fill``). Differentiable."""
    v = v.double().repeat_interleave(q.size(1) // v.size(1), dim=1)
    if fully_masked == "zero":
        probs = torch.softmax(_scores_fp64(q, k, visible, scale, softcap, bias), dim=-1).nan_to_num(0.0)
        return probs @ v
    scores = _scores_fp64(q, k, torch.ones_like(visible), scale, softcap, bias)
    lowest = torch.finfo(torch.float64).min
    if fully_masked == "uniform":
        scores = scores + torch.zeros_like(scores).masked_fill(~visible, lowest)
    else:
        scores = scores.masked_fill(~visible, lowest)
    return torch.softmax(scores, dim=-1) @ v


def masked_lse_fp64(q, k, visible: torch.Tensor, scale: float | None = None, *, softcap=None, bias=None):
    """log-sum-exp of each query row's visible scores in fp64 (-inf for a row with no visible key)."""
    return torch.logsumexp(_scores_fp64(q, k, visible, scale, softcap, bias), dim=-1)


def _scores_fp64(q, k, visible, scale, softcap, bias):
    q, k = q.double(), k.double()
    scale = q.size(-1) ** -0.5 if scale is None else scale
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.double()
    return scores.masked_fill(~visible, float("-inf"))


def grad_error(grads: dict, expected: dict) -> float:
    """The largest relative error over parameters; a gradient that is zero in exact arithmetic (a bias
    that a later mean subtracts again, a key bias under softmax) is measured against 1e-4 of the largest
    gradient instead (at 1e-6 its fp64 rounding alone reaches 1e-10 on 4 ranks)."""
    floor = 1e-4 * max(g.abs().max().item() for g in expected.values())
    return max(((grads[k] - g).abs().max() / max(g.abs().max().item(), floor)).item() for k, g in expected.items())


def recurrent_gated_delta_rule(
    query,
    key,
    value,
    g,
    beta,
    chunk_size=64,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
):
    """The gated delta rule by its definition, one token at a time in the inputs' dtype, with the signature of Hugging
    Face's ``torch_chunk_gated_delta_rule`` (``chunk_size`` unused): ``S_t = exp(g_t) S_(t-1)``, then
    ``S_t += beta_t k_t (v_t - k_t^T S_t)^T``, output ``q_t^T S_t / sqrt(dk)``."""
    q, k, v, b, decay = (x.transpose(1, 2) for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    state = q.new_zeros((*q.shape[:2], k.shape[-1], v.shape[-1])) if initial_state is None else initial_state.to(q)
    out = []
    for t in range(q.shape[2]):
        state = state * decay[:, :, t, None, None].exp()
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * b[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None]
        out.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, 2).transpose(1, 2), (state if output_final_state else None)


def recurrent_ssd(
    hidden_states,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    dt_bias=None,
    initial_states=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
):
    """Mamba2's scan by its definition, one token at a time in the inputs' dtype, with the signature of Hugging Face's
    ``mamba2_chunk_scan`` (``chunk_size`` unused): ``S_t = exp(A dt_t) S_(t-1) + dt_t x_t B_t^T``, output
    ``S_t C_t + D x_t``, ``dt`` biased, softplus'd and clamped first."""
    batch, n, heads, _ = hidden_states.shape
    dt = dt + dt_bias if dt_bias is not None else dt
    dt = (F.softplus(dt) if dt_softplus else dt).clamp(*dt_limit)
    B, C = (x.repeat_interleave(heads // x.shape[2], 2) for x in (B, C))
    state = (
        hidden_states.new_zeros(batch, heads, hidden_states.shape[-1], B.shape[-1])
        if initial_states is None
        else initial_states.to(hidden_states)
    )
    out = []
    for t in range(n):
        x_t = hidden_states[:, t]
        state = (A * dt[:, t]).exp()[..., None, None] * state + (dt[:, t, :, None] * x_t)[..., None] * B[:, t, :, None]
        out.append((state * C[:, t, :, None]).sum(-1) + (D[:, None] * x_t if D is not None else 0))
    out = torch.stack(out, 1)
    return (out, state) if return_final_states else out
