"""What the service reports about itself: `logs` (JSON or text, with the task's context), `task_metrics` (Celery
task outcomes), `worker_metrics` (a worker's /metrics), `service_metrics` (the API's /metrics), `health` (/readyz)."""
