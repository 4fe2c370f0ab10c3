"""Recurring batches and RAG jobs: `definitions` (what the routes do), `cron` (fire times in a time zone) and
`firing` (beat's sweep, exactly once per fire time)."""
