"""The OpenAI Batch format: `requests` (request bodies and the requests a valid line becomes), `validation` (one
input line → a request or a line error; the body itself is read by its endpoint format, `jobs.formats`), `responses`
(response bodies, the output line), `records` (engine results and embeddings → output lines) and `reasoning` (the
thinking of templates that think, kept apart). Pure apart from a tokenizer: the service and `conveyor run` share it."""
