"""The engine: model loading, chat rendering, prefill/decode with state reuse, sampling, scheduling."""
