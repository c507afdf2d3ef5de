"""`lowering.ring_args.RingArgs`, the one spelling of the ring ops' arguments: the schemas derived from it are the
ones compiled graphs and saved ``torch.export`` programs call positionally, and a call built from it reads back."""

import operator

import torch
import torch.fx as fx

import lowering  # noqa: F401 -- registers the ops
from lowering.ring_args import PROGRAM_INPUTS, RingArgs

# The schemas a saved program calls the ops by, by position (a new field: a new converted-model format version).
FORWARD = (
    "ringpass::ring_attention(Tensor q, Tensor k, Tensor v, str layout_kind, SymInt world_size, SymInt seq_len, "
    "bool is_causal, float scale, str group_name, SymInt? window, str mask_id, Tensor[] mask_inputs, "
    "float? softcap, float[]? alibi_slopes, str bias_id, Tensor[] bias_inputs, str fully_masked, SymInt ulysses, "
    "str strategy) -> (Tensor, Tensor)"
)
BACKWARD = (
    "ringpass::ring_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor? dlse, str layout_kind, SymInt world_size, SymInt seq_len, bool is_causal, float scale, "
    "str group_name, SymInt? window, str mask_id, Tensor[] mask_inputs, float? softcap, float[]? alibi_slopes, "
    "str bias_id, Tensor[] bias_inputs, str fully_masked, SymInt ulysses, str strategy, SymInt[] trained) "
    "-> (Tensor, Tensor, Tensor, Tensor[])"
)


def test_the_op_schemas_are_the_ones_saved_programs_call():
    assert str(torch.ops.ringpass.ring_attention.default._schema) == FORWARD
    assert str(torch.ops.ringpass.ring_attention_backward.default._schema) == BACKWARD


def test_every_field_sits_where_the_schemas_name_it():
    forward = [a.name for a in torch.ops.ringpass.ring_attention.default._schema.arguments]
    backward = [a.name for a in torch.ops.ringpass.ring_attention_backward.default._schema.arguments]
    for field in RingArgs._fields:
        assert forward[RingArgs.position(field)] == field
        assert backward[RingArgs.position(field) + 4] == field  # dout before q; out, lse, dlse after v
    assert [forward[RingArgs.position(f)] for f in PROGRAM_INPUTS] == ["mask_inputs", "bias_inputs"]


def _example() -> tuple[RingArgs, list[torch.Tensor]]:
    """Arguments with no field at its default, and the tensors the programs read."""
    mask_input, first_bias, second_bias = torch.zeros(3), torch.ones(2), torch.full((4,), 2.0)
    args = RingArgs(
        "contiguous",
        2,
        16,
        True,
        0.5,
        "7",
        4,
        "mask-1",
        (mask_input,),
        30.0,
        (0.5, 0.25),
        "bias-2",
        (first_bias, second_bias),
        "uniform",
        2,
        "all-gather",
    )
    return args, [mask_input, first_bias, second_bias]


def test_a_call_built_from_the_fields_reads_back_as_them():
    args, tensors = _example()
    op_args = args.op_args()
    assert [type(op_args[RingArgs._fields.index(f)]) for f in (*PROGRAM_INPUTS, "alibi_slopes")] == [list] * 3
    graph = fx.Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    node = graph.call_function(torch.ops.ringpass.ring_attention.default, (q, k, v, *op_args))
    graph.output(graph.call_function(operator.getitem, (node, 0)))
    read = RingArgs.of_call(node.args, node.kwargs)
    assert read == args._replace(
        mask_inputs=list(args.mask_inputs), alibi_slopes=[0.5, 0.25], bias_inputs=list(args.bias_inputs)
    )
    keyword = RingArgs.of_call(node.args[:3], dict(zip(RingArgs._fields, op_args), q=q))  # as a normalised call
    assert keyword == read


def test_program_inputs_come_out_and_go_back_in_the_backward_ops_order():
    args, tensors = _example()
    assert args.program_inputs() == tensors
    replaced = [t + 1 for t in tensors]
    back = args.with_program_inputs(replaced)
    assert back.mask_inputs == replaced[:1] and back.bias_inputs == replaced[1:]
    assert back._replace(mask_inputs=args.mask_inputs, bias_inputs=args.bias_inputs) == args


def test_programs_name_each_mask_and_bias_program_with_what_it_reads():
    args, tensors = _example()
    assert args.programs() == {args.mask_id: tensors[:1], "bias-2": tensors[1:]}
    assert args._replace(mask_id="", mask_inputs=[]).programs() == {"bias-2": tensors[1:]}
    assert RingArgs("zigzag", 2, 8, True, 1.0, "").programs() == {}
