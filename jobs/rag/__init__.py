"""RAG preprocessing: documents in (`documents`), token-budgeted passages (`splitter`), contexts from the engine
(`contextualize`), embedded and cached passage records out as Parquet (`processing`); a RAG job as the client sees
it (`jobs`) and as the worker runs it (`kind`, a `jobs.run.kinds.JobKind`).

`documents` and `splitter` are pure functions over bytes and strings; fetching from S3 is the caller's.
"""
