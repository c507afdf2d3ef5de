"""ringpass with the rest of a job: loaders (`data`), sharded inputs and outputs (`sharding`), and generation from
a long prompt with the KV cache kept sharded (`generation`)."""
