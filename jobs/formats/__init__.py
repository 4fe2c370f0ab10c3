"""Endpoint formats: one module per wire format a batch line can be written in, behind `base.EndpointFormat`.

A format reads a line's body into an engine request and (for the formats that generate) writes the engine's result
as its answer, with its usage. `registry` lists them by their url; the validator (`jobs.openai_format.validation`)
and the output records (`jobs.openai_format.records`) look a line's format up there and never ask which it is.
Adding a format is adding a module and its registry entry.
"""
