"""RAG preprocessing's document layer: documents in (`documents`), token-budgeted chunks out (`splitter`).

Pure functions over bytes and strings: fetching from S3, contextualizing and embedding are the caller's.
"""
