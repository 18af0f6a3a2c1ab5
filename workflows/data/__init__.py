"""Data into the chunked stores the ranks read their shards from: the preprocessing graph run as
Dask tasks (``preprocess``), the stores and their manifests (``stores``), arrays and text
written as stores (``array_store``, ``text_store``)."""
