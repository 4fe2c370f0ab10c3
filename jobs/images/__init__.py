"""Images in batch lines, the request side: what a line's image parts name (`inputs`), their bytes fetched
(`sources`: data URLs, https with the webhook's SSRF guard, the project's own `s3://` inbox), decoded within the
deployment's limits (`decode`), ahead of the engine on a chunk's own threads (`prefetch`)."""
