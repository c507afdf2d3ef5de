"""`head_groups.repeated_groups`: heads proven to repeat in consecutive groups, never claimed otherwise.

Each case builds keys from 2 distinct heads in a Dynamo-captured graph; the claimed group size is checked
against the one written here and against the values themselves (every claimed group really is equal)."""

import pytest
import torch
import torch.nn.functional as F

from ringpass.fx.head_groups import repeated_groups
from ringpass.fx.spellings import SDPA

B, HKV, G, S, D = 2, 2, 3, 5, 4  # 2 distinct heads, 3 query heads each


def _falcon(k, cos):  # [B, S, Hkv, 1, D] broadcast over its group, merged into heads, then rotary
    k = torch.broadcast_to(k, (B, S, HKV, G, D)).flatten(2, 3).transpose(1, 2).reshape(B, HKV * G, S, D)
    x1, x2 = k[..., : D // 2], k[..., D // 2 :]
    return k * cos[:, None] + torch.cat((-x2, x1), dim=-1) * cos[:, None]


CASES = {  # name: (keys from k [B, S, Hkv, 1, D] and cos [B, S, D], the group size to prove)
    "falcon: broadcast, merge, rotary": (_falcon, G),
    "expand, reshape, scaled, cast": (
        lambda k, cos: (k.expand(B, S, HKV, G, D).reshape(B, S, HKV * G, D).transpose(1, 2) * 0.5).float(),
        G,
    ),
    "tiled, not grouped (h -> h % Hkv)": (
        lambda k, cos: k.squeeze(3)[:, :, None].expand(B, S, G, HKV, D).reshape(B, S, G * HKV, D).transpose(1, 2),
        1,
    ),
    "a per-head weight after the repeat": (
        lambda k, cos: _falcon(k, cos) * torch.arange(HKV * G, dtype=k.dtype)[None, :, None, None],
        1,
    ),
    "a weight constant over each group (true, not proven)": (
        lambda k, cos: _falcon(k, cos) * torch.arange(HKV, dtype=k.dtype).repeat_interleave(G)[None, :, None, None],
        1,
    ),
    "a slice of the heads": (lambda k, cos: _falcon(k, cos)[:, 1:], 1),
    "noise after the repeat": (lambda k, cos: F.dropout(_falcon(k, cos), 0.5), 1),
    "heads concatenated (true, not proven)": (
        lambda k, cos: torch.cat((_falcon(k, cos)[:, :G], _falcon(k, cos)[:, G:]), dim=1),
        1,
    ),
}


def _claimed(build) -> tuple[int, torch.Tensor]:
    found = []

    def backend(gm, example_inputs):
        (sdpa,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA]
        found.append(repeated_groups(sdpa.args[1], 1))
        return gm.forward

    def model(q, k, cos):
        keys = build(k, cos)
        return F.scaled_dot_product_attention(q[:, : keys.shape[1]], keys, keys), keys

    torch._dynamo.reset()
    torch.manual_seed(0)
    q, k, cos = torch.randn(B, HKV * G, S, D), torch.randn(B, S, HKV, 1, D), torch.randn(B, S, D)
    _, keys = torch.compile(model, backend=backend, fullgraph=True)(q, k, cos)
    return found[0], keys


@pytest.mark.parametrize("name", list(CASES))
def test_repeated_heads_are_proven_and_only_when_true(name):
    build, expected = CASES[name]
    groups, keys = _claimed(build)
    assert groups == expected
    heads = keys.shape[1]
    for h in range(heads):  # the claim holds on the values
        assert torch.equal(keys[:, h], keys[:, h - h % groups])
