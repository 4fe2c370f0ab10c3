"""A job's run after it is created: validate → run_chunk × N → finalize (`pipeline`), over the pieces it
orchestrates: `split` (input lines into chunks), `lease` (one worker per chunk), `ledger` (exactly-once
bookkeeping), `finalize` (the job's files) and `kinds` (what differs per kind of job, one module per kind)."""
