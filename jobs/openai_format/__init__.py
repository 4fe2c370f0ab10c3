"""The OpenAI Batch format: `requests` (request bodies and the requests a valid line becomes), `validation` (one
input line → a request or a line error), `responses` (response bodies, the output line) and `records` (engine
results and embeddings → output lines). Pure apart from a tokenizer: the service and `conveyor run` share it."""
