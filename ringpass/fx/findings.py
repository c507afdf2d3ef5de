"""What the analysis passes find, as typed records: `AttentionMatch` (`find_attention`), `MixerMatch`
(`find_sequence_mixers`), `MaskPlan` and
`MaskFindings` (`lift_masks`), `SeqDim` and `SequenceFindings` (`find_sequence_axes`). `PassContext` holds one
of each; a pass that reads a finding imports its type from here, not from the pass that writes it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ringpass.fx.nodes import example_value, plain


@dataclass(frozen=True)
class AttentionMatch:
    """One attention: ``output`` is the node whose value is softmax(q kᵀ s + mask) v."""

    output: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    is_causal: bool
    scale: float | None
    spelling: str  # "sdpa" or "hand-written"
    internal: tuple[fx.Node, ...] = ()  # nodes of a hand-written attention that the rewrite removes
    mask: tuple[str, fx.Node] | None = None  # ("kept" | "masked_out" | "additive", the mask's node)
    fill: float | None = None  # the value masked scores get (masked_fill / where), when it is one number
    softcap: float | None = None  # scores c·tanh(s / c)
    bias: fx.Node | None = None  # an additive score bias inside the mask (ALiBi, a position bias)
    batch: int | None = None  # q, k, v hold batch and heads merged in dim 0 ([B·H, S, D]); this is B
    flex: FlexMods | None = None  # a flex_attention call's mask_mod and score_mod
    outer_scale: float = 1.0  # a scale applied outside the mask and bias: their values scale with it
    inner_masks: tuple = ()  # further masks inside ``mask``: ((kind, node), fill) each, outermost first
    kv_groups: int = 1  # K and V heads repeat in consecutive groups of this size: one of each travels

    def sizes(self) -> tuple[int, int, int]:
        """(batch, query heads, key/value heads, one per group of repeated heads) at the traced shapes."""
        q, k = example_value(self.query), example_value(self.key)
        if q.dim() == 4:
            return plain(q.shape[0]), plain(q.shape[1]), plain(k.shape[1]) // self.kv_groups
        if self.batch is None:  # single-head 3-D attention
            return plain(q.shape[0]), 1, 1
        batch = plain(self.batch)
        return batch, plain(q.shape[0]) // batch, plain(k.shape[0]) // batch  # heads merged with the batch in dim 0


@dataclass(frozen=True)
class MixerMatch:
    """A sequence mixer other than attention that the ring runs on this rank's tokens, each chunk with a summary
    of the chunks before it (`lowering.sequence_mixers`): ``kind`` "causal_conv1d" (``conv1d(x [B, C, N], weight
    [C, 1, k], bias, padding=k-1, groups=C)`` then ``[..., :N]``: ``internal`` holds the conv, ``output`` the slice)
    or "cumsum" (``cumsum(x, dim)`` of a floating activation, ``output`` the cumsum). ``dim``: the sequence axis of
    ``input`` it runs along (a cumsum's may still prove not to be the sequence: the rewrite checks)."""

    kind: str
    output: fx.Node
    input: fx.Node
    dim: int
    weight: fx.Node | None = None
    bias: fx.Node | None = None
    width: int = 0  # the convolution's kernel size
    internal: tuple[fx.Node, ...] = ()

    def describe(self) -> str:
        if self.kind == "causal_conv1d":
            channels = plain(example_value(self.input).shape[1])
            return f"causal depthwise conv1d, width {self.width}, {channels} channels"
        return f"cumulative sum along dim {self.dim}"


@dataclass(frozen=True)
class FlexMods:
    """What a ``flex_attention`` call computes besides ``softmax(q kᵀ s) v``: ``mask_mod(b, h, q_idx, kv_idx,
    *mask_buffers)`` and ``score_mod(score, b, h, q_idx, kv_idx, *score_buffers)`` (GraphModules)."""

    mask_mod: fx.GraphModule
    score_mod: fx.GraphModule
    mask_buffers: tuple
    score_buffers: tuple


@dataclass
class MaskPlan:
    """How the ring applies one attention's mask (flags, or a program with its whole inputs) and score
    modifiers (soft-cap, ALiBi slopes, a bias program with its whole inputs)."""

    is_causal: bool = False
    window: int | None = None
    program_id: str = ""
    inputs: list = field(default_factory=list)
    softcap: float | None = None
    slopes: list | None = None
    bias_id: str = ""
    bias_inputs: list = field(default_factory=list)
    fully_masked: str = "zero"  # what a query whose keys are all hidden gives (lowering.fully_masked)
    documents: str = ""  # with the documents mask (`lowering.masks.DOCUMENTS`): how the model packs them, in words

    def describe(self) -> str:
        if self.documents:
            causal = " + causal inside each" if self.is_causal else ""
            return f"packed documents ({self.documents}){causal}{self._window()}, tiles decided from the ids' ranges"
        if self.program_id:
            return f"lifted mask program{' + causal' if self.is_causal else ''}{self._window()}, evaluated per tile"
        return ("causal" if self.is_causal else "no mask") + self._window()

    def score_mods(self) -> list[str]:
        """The score modifiers in words, for the report."""
        return (
            ([f"soft-cap {self.softcap:g}"] if self.softcap is not None else [])
            + (["ALiBi slopes, computed in-kernel from positions"] if self.slopes is not None else [])
            + (["lifted bias program, evaluated per tile"] if self.bias_id else [])
        )

    def op_args(self) -> dict:
        """The ring op's mask and score arguments, by their `lowering.ring_args.RingArgs` names."""
        return dict(
            window=self.window,
            mask_id=self.program_id,
            mask_inputs=list(self.inputs),
            softcap=self.softcap,
            alibi_slopes=self.slopes,
            bias_id=self.bias_id,
            bias_inputs=list(self.bias_inputs),
            fully_masked=self.fully_masked,
        )

    def _window(self) -> str:
        return f", sliding window {self.window}" if self.window is not None else ""


@dataclass(frozen=True)
class SeqDim:
    """Dimension ``dim`` of a value holds the sequence: its size is outer x seq x ``inner`` (a reshape can
    merge neighbours into it); ``aligned`` is False when its length is not the sequence length
    (``x[:, 1:]``, a concatenation) and it cannot be sharded."""

    dim: int
    inner: int = 1
    aligned: bool = True


@dataclass
class MaskFindings:
    """What `lift_masks` found: each attention's `MaskPlan` (by the attention's output node), the mask and bias
    nodes the ring evaluates instead (``lifted``), and the values their programs read, kept whole on every
    rank (``whole_values``)."""

    plans: dict[fx.Node, MaskPlan] = field(default_factory=dict)
    lifted: set[fx.Node] = field(default_factory=set)
    whole_values: set[fx.Node] = field(default_factory=set)


@dataclass(frozen=True)
class WholeRegion:
    """A function call run on the whole sequence on every rank: ``function`` its name, ``call_site`` where it is
    called ("file, line N, in caller"), ``internal`` its nodes (graph order), ``entries`` the values from outside it
    reads, ``exits`` its values read outside it (each with its sequence dim), ``why`` the op that cannot run on a
    shard."""

    function: str
    call_site: str
    internal: tuple[fx.Node, ...]
    entries: tuple[fx.Node, ...]
    exits: tuple[tuple[fx.Node, int], ...]
    why: str


@dataclass(frozen=True)
class HeadSplit:
    """How a `WholeRegion` that keeps its ``heads`` apart runs on every token of H / P of them on each rank
    (`find_region_heads`): ``entries`` maps each value it reads to its head dim (None: it has none, and is read
    whole: all-gathered where it is this rank's tokens); ``narrowed`` the nodes inside it whose output is the first
    with a head dim (a value repeated to every head, a state created with H heads) to that dim, narrowed to this
    rank's heads after them; ``respelled`` the ops inside it that spell sizes, to their args with the head sizes
    divided by P; ``exits`` each value read outside it to (its sequence dim, its head dim)."""

    heads: int
    entries: dict[fx.Node, int | None]
    narrowed: dict[fx.Node, int]
    respelled: dict[fx.Node, tuple]
    exits: dict[fx.Node, tuple[int, int]]


@dataclass(frozen=True)
class ScanBinding:
    """A `WholeRegion` that calls a known chunked scan, bound to it (`find_scan_states`): ``adapter`` a key of
    ``lowering.state_passing.ADAPTERS``, ``module`` and ``function`` the function it calls, ``constants`` the keyword
    constants it was called with ((name, value) pairs), ``tokens`` its values given as the function's per-token
    arguments and ``weights`` as its weights (None: not given), in the adapter's order; ``exit`` its output;
    ``summary_bytes`` one chunk's summary (what a rank sends per chunk it holds); ``predicted``: with ``scans="auto"``,
    the cost model's seconds for both strategies."""

    adapter: str
    module: str
    function: str
    constants: tuple
    tokens: tuple[fx.Node, ...]
    weights: tuple[fx.Node | None, ...]
    exit: fx.Node
    summary_bytes: int
    predicted: str = ""


@dataclass
class SequenceFindings:
    """What `find_sequence_axes` found: the sequence length the graph sees (``seq_len``: this rank's with
    ``inputs="sharded"``, a SymInt with dynamic shapes) and the model input's (``global_seq_len``); each value's
    sequence dims (``axes``); the ops that mix tokens (``mixing``: node -> why; `find_local_permutations` drops
    the ones that only permute a rank's own tokens), reduce over the sequence (``reductions``: node -> "sum" |
    "mean" | "cross_entropy" | "pick") or bring the sequence in (``sources``: node -> "input" | "positions" |
    "created" | "sliced"); the SymInt inputs whose value is the sequence length (``length_nodes``); and the function
    calls computed on the whole sequence on every rank (``regions``: a chunked scan, `ringpass.fx.call_regions`), and
    for each of them the `HeadSplit` that runs it on a share of its heads on each rank, or why it cannot
    (``heads``, `find_region_heads`), and with ``scans="state"`` the `ScanBinding` that passes its state, or why not
    (``states``, `find_scan_states`)."""

    seq_len: int | torch.SymInt = 0
    global_seq_len: int = 0
    axes: dict[fx.Node, tuple[SeqDim, ...]] = field(default_factory=dict)
    mixing: dict[fx.Node, str] = field(default_factory=dict)
    reductions: dict[fx.Node, str] = field(default_factory=dict)
    sources: dict[fx.Node, str] = field(default_factory=dict)
    length_nodes: set[fx.Node] = field(default_factory=set)
    regions: list[WholeRegion] = field(default_factory=list)
    heads: dict[WholeRegion, HeadSplit | str] = field(default_factory=dict)
    states: dict[WholeRegion, ScanBinding | str] = field(default_factory=dict)
