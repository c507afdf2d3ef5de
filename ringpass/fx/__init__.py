"""Helpers over Dynamo's FX graphs: what the passes share, apart from the passes themselves (``ringpass/passes/``:
one pass per file), and what the front ends read of a graph. Nothing here imports a front end.

- `nodes`: where a node came from (the user's source line, module path), its example value, what kind of input.
- `report`: `Report`, what one compile found and did, pass by pass, as data and as text for people.
- `chains`: the chain of ops between an attention and the op that blocks its rewrite, as a refusal names it.
- `context`: `PassContext` (the graph, the options and each analysis's findings), `Placement` and `GradientMode`.
- `findings`: what the analysis passes find, as typed records (`AttentionMatch`, `MaskFindings`, `SequenceFindings`).
- `spellings`: the one table of op spellings (casts, views, copies, attention ops...) and `op_name`.
- `sizes`: sizes compared without guards, and the ops that spell sizes (rescaled to another length).
- `token_ops`: which ops act on each token separately (the rule that keeps sharded activations honest).
- `score_terms`: reading a score expression: its scale, soft-cap and additive terms.
- `head_groups`: heads proven to repeat in groups.
- `flex_mods`: a ``flex_attention`` call's ``mask_mod`` and ``score_mod`` as the ring's programs.
- `gradient_reach`: which values' gradients reach the outputs (the rules both gradient-path passes use).
- `runner`: `Stage` and `PassRunner`: passes run in named stages, logged, checked and written after each when
  asked (`RINGPASS_CHECK_PASSES=1`, `RINGPASS_DEBUG_DIR`).
"""
