"""RAG preprocessing: documents in (`documents`), token-budgeted chunks (`splitter`), contexts from the engine
(`contextualize`), embedded and cached chunk records out as Parquet (`processing`).

`documents` and `splitter` are pure functions over bytes and strings; fetching from S3 is the caller's.
"""
