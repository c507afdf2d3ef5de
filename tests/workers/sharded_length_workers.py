"""What each rank runs in test_sharded_lengths: models that read the sequence length as a number, compiled
with ``inputs="sharded", outputs="sharded"`` (each rank passes its `ringpass.shard` and keeps its shard of the
logits), against the same model run whole in the same process (fp32, the same seed on every rank)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import rel_err

import ringpass
from lowering import Layout, record_ring_events

VOCAB = 61


class ScaledByLength(nn.Module):
    """Embedding scaled by ``x.shape[1] / 10`` and divided by the length after attention (SDPA)."""

    def __init__(self, specialize: bool = False, shift: bool = False):
        super().__init__()
        self.specialize, self.shift = specialize, shift
        self.embed = nn.Embedding(VOCAB, 32)
        self.qkv = nn.Linear(32, 96)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x):
        h = self.embed(x) * (x.shape[1] / 10)
        if self.specialize and x.shape[1] == 8:  # a Python branch on the length: Dynamo fixes it to this number
            h = h * 2
        if self.shift:  # the length as a shift of the features: neither a size of the sequence nor a plain number
            h = torch.roll(h, x.shape[1] // 4, -1)
        b, n, _ = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 32)
        return self.head(a + h / x.shape[1])


def esm() -> nn.Module:
    """The reported model: ESM masked LM with token dropout (its embeddings divide by ``input_ids.shape[1]``),
    rotary positions, no attention mask."""
    from transformers import EsmConfig, EsmForMaskedLM

    config = EsmConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        pad_token_id=1,
        mask_token_id=2,
        token_dropout=True,
        position_embedding_type="rotary",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=512,
    )
    config._attn_implementation = "sdpa"
    return EsmForMaskedLM(config).eval()


MODELS = {
    "scaled": ScaledByLength,
    "esm": esm,
    "specialized": lambda: ScaledByLength(specialize=True),
    "shift": lambda: ScaledByLength(shift=True),
}


def _ids(seq_len: int, seed: int) -> torch.Tensor:
    ids = torch.randint(3, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(seed))
    ids[0, 1::5] = 2  # mask tokens: ESM's token dropout counts them per row
    ids[1, ::7] = 2
    return ids


def _logits(output):
    return output.logits if hasattr(output, "logits") else output


def compare(rank: int, world_size: int, name: str, dynamic, lengths: tuple) -> dict:
    """Each length called once on one compiled model: the shard's error against the unsharded model's logits,
    the reassembled logits' error, the ring's KV exchanges; the compiles it took; marks left on the input;
    or the refusal's type and message."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = MODELS[name]()
    backend = ringpass.backend(inputs="sharded", outputs="sharded", compiler="eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    result = {"errors": [], "gathered": [], "kv": [], "marks": [], "compiles": []}
    for seq_len in lengths:
        ids = _ids(seq_len, seed=seq_len)
        with torch.no_grad():
            expected = _logits(model(ids))
            shard = ringpass.shard(ids, 1)
            try:
                with record_ring_events() as events:
                    got = _logits(compiled(shard))
            except Exception as error:
                result["refused"] = (type(error).__name__, isinstance(error, ringpass.NotSupportedError), str(error))
                return result
        result["errors"].append(rel_err(got, Layout("zigzag", world_size, seq_len).shard(expected, 1, rank)))
        result["gathered"].append(rel_err(ringpass.unshard(got, 1, seq_len=seq_len), expected))
        result["kv"].append(sum(e.kind == "exchange" and e.fields.get("payload") == "kv" for e in events))
        result["marks"].append(
            sorted(k for k in vars(shard) if k.startswith("_dynamo") or k == "_has_dynamo_dim_marking")
        )
        result["compiles"].append(len(backend.reports))
    result["positions"] = [line for r in backend.reports for line in r.positions]
    return result


def run_cases(rank: int, world_size: int, cases: list) -> dict:
    """``cases``: (case id, compare's arguments after world_size as a dict)."""
    return {case_id: compare(rank, world_size, **kwargs) for case_id, kwargs in cases}
