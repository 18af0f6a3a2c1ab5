"""One module per parallelism, each with one keyword-only entry function that wraps a model."""
