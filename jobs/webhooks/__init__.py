"""Webhooks: `endpoints` (what a project registers), `events` (a batch's end → an event and its deliveries),
`delivery` (signed, retried POSTs), `targets` (the SSRF guard and the pinned POST), `signing` (Standard Webhooks)."""
