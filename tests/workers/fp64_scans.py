"""Chunked scans with the names and signatures of the ones ringpass knows (`ringpass.fx.known_scans`), computed in the
inputs' dtype: Hugging Face's ``torch_chunk_gated_delta_rule`` and ``mamba2_chunk_scan`` compute in fp32 whatever they
are given, so an fp64 model on them cannot be compared to 1e-10. These cut the sequence into chunks with a reshape, as
Hugging Face's do, and run each chunk token by token (`reference`'s recurrences) from the state the chunk before it
left: the same recurrences, in fp64, that ``scans="state"`` binds by name and passes the state of."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from reference import recurrent_gated_delta_rule, recurrent_ssd


def _chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``x [B, N, ...]`` padded with zeros to whole chunks and cut into them: ``[B, chunks, chunk_size, ...]``."""
    pad = (chunk_size - x.shape[1] % chunk_size) % chunk_size
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])


def torch_chunk_gated_delta_rule(
    query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False,
):  # fmt: skip
    """The gated delta rule chunk by chunk (a padded token decays by 1 and writes nothing: ``g = beta = 0``)."""
    n, state, out = query.shape[1], initial_state, []
    chunks = [_chunks(x, chunk_size) for x in (query, key, value, g, beta)]
    for c in range(chunks[0].shape[1]):
        o, state = recurrent_gated_delta_rule(
            *(x[:, c] for x in chunks), initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )  # fmt: skip
        out.append(o)
    return torch.cat(out, 1)[:, :n], (state if output_final_state else None)


def mamba2_chunk_scan(
    hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
    dt_limit=(0.0, float("inf")), return_final_states=False,
):  # fmt: skip
    """Mamba2's scan chunk by chunk, ``dt`` biased, softplus'd and clamped before the padding, as Hugging Face's does
    (a padded token's ``dt`` is 0: it neither decays the state nor writes to it)."""
    dt = dt + dt_bias if dt_bias is not None else dt
    dt = (F.softplus(dt) if dt_softplus else dt).clamp(dt_limit[0], dt_limit[1])
    n, state, out = hidden_states.shape[1], initial_states, []
    chunks = [_chunks(x, chunk_size) for x in (hidden_states, dt, B, C)]
    for c in range(chunks[0].shape[1]):
        x, step, b, cc = (t[:, c] for t in chunks)
        o, state = recurrent_ssd(x, step, A, b, cc, chunk_size, D=D, initial_states=state, return_final_states=True)
        out.append(o)
    out = torch.cat(out, 1)[:, :n]
    return (out, state) if return_final_states else out
