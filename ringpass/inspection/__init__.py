"""`ringpass.inspect`: what the ring pass will do to a model, before it runs, and the ways to look at it.

- `inspector`: `inspect` and `Inspection` (the rewritten graphs, their reports).
- `graph_view`: a rewritten graph as a networkx graph; `picture`: drawn with matplotlib.
- `targets`: what ``ringpass inspect`` inspects: a user's factory, or a Hugging Face config on the meta device.
"""
