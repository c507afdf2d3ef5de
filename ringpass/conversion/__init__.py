"""The parts of `ringpass.convert`, one concern per module (this package re-exports none of them):

- `saved`: what a conversion records besides its program and parameters (`Conversion`), and what an artifact saves;
- `calls`: a call bound as the model's ``forward`` binds it, checked against the conversion, and the graph's inputs
  read from it;
- `capture`: Dynamo's one graph of the model, rewritten by the pass pipeline, and the call and outputs as it sees them;
- `runtime`: the `ConvertedModel` that runs the rewritten graph eagerly;
- `archive`: the ``torch.export`` archive a converted model is saved as (`ringpass.conversion.artifact` loads it).
"""
