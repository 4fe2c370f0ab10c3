"""How large one batch may be: OpenAI's limits for `/v1/batches`, Anthropic's for `/v1/messages/batches` (each a
setting, `jobs.settings`; Anthropic's are checked where its requests arrive, `jobs.message_batches`).

The input file's size is known when the batch is created, and refused then (`check_input_size`); its count of
requests, and of embedding inputs across an embeddings batch's lines, once validate has read every line: a batch
over either fails with `too_many_tasks` (OpenAI's code), none of its lines run.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobs.errors import ServiceError

TOO_MANY_TASKS = "too_many_tasks"


def check_input_size(size: int, max_input_bytes: int) -> None:
    """Refuse, at creation, a batch whose input file is larger than the limit."""
    if size > max_input_bytes:
        raise ServiceError(
            "invalid_request",
            f"The batch input file is larger than the {max_input_bytes} maximum ({size} bytes). Please try again "
            "with a smaller batch.",
            param="input_file_id",
        )


@dataclass(frozen=True)
class BatchLimits:
    max_requests: int  # lines of one batch's input
    max_input_bytes: int  # bytes of one batch's input
    max_embedding_inputs: int  # texts across the lines of one embeddings batch

    def refusal(self, requests: int, embedding_inputs: int) -> tuple[str, str] | None:
        """(code, message) failing a batch whose validated input holds more than the limits allow; None if it fits."""
        if requests > self.max_requests:
            return TOO_MANY_TASKS, (
                f"The batch input file holds {requests} requests, more than the {self.max_requests} a batch may hold. "
                "Please try again with a smaller batch."
            )
        if embedding_inputs > self.max_embedding_inputs:
            return TOO_MANY_TASKS, (
                f"The batch's requests hold {embedding_inputs} embedding inputs, more than the "
                f"{self.max_embedding_inputs} an embeddings batch may hold across its requests. Please try again "
                "with a smaller batch."
            )
        return None


@dataclass(frozen=True)
class MessageBatchLimits:
    """Anthropic's limits on one Message Batch, whose requests arrive inline: both are checked at creation."""

    max_requests: int  # requests in one batch
    max_bytes: int  # bytes of one batch's requests, as its input file holds them
