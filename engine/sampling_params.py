"""Per-request sampling parameters, validated at construction so bad values fail before scheduling."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.structured_output import StructuredOutputParams


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Field semantics follow vLLM / the OpenAI API.

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p 1.0 and min_p 0.0 disable
    those filters. Penalties at their neutral values (1.0 repetition, 0.0 presence/frequency) cost
    nothing. `seed` makes sampling reproducible regardless of which other requests share the batch.

    `best_of` samples that many sequences and returns the `n` with the highest cumulative log-prob.
    Beam search (`use_beam_search`) keeps `beam_width` beams, scores finished ones by cumulative
    log-prob / generated length ** `length_penalty` (as Hugging Face does) and returns the `n` best;
    it is deterministic, so it requires temperature 0 and no top-k/top-p/min-p, as vLLM did.

    `structured_output` constrains every sample to a JSON schema, any JSON object, a regex, a choice or a
    grammar (engine/structured_output.py); eos is then allowed only where the grammar may end.
    `logit_bias` adds a bias in [-100, 100] to a token id's logit before sampling (OpenAI's semantics:
    -100 bans the token, 100 all but forces it).

    `prompt_logprobs` (vLLM's): the log-prob of every prompt token under the model given the tokens before it,
    with that many top alternatives each (the first token has none: nothing predicts it). They come from the
    prefill's logits, so such a request computes its whole prompt: it takes nothing from the prefix cache.

    `adapter` names a LoRA adapter registered with the engine (`LLMEngine.add_lora`, like vLLM's LoRARequest): the
    request runs on the base model plus that adapter; None: the base model alone.
    """

    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    beam_width: int = 4
    length_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutputParams | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    adapter: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(token): float(bias) for token, bias in (self.logit_bias or {}).items()}
        self._validate()

    def _validate(self) -> None:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        require(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        require(
            self.best_of is None or (isinstance(self.best_of, int) and self.best_of >= self.n),
            f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}",
        )
        if self.use_beam_search:
            require(self.best_of is None, "best_of does not apply to beam search; set beam_width")
            require(
                isinstance(self.beam_width, int) and self.beam_width >= max(2, self.n),
                f"beam_width must be an integer >= max(2, n), got {self.beam_width!r}",
            )
            require(self.temperature == 0.0, "beam search is deterministic: temperature must be 0")
            require(
                self.top_p == 1.0 and self.top_k in (-1, 0) and self.min_p == 0.0,
                "beam search does not combine with top_p, top_k or min_p",
            )
        require(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        require(self.top_k == -1 or self.top_k >= 0, f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        require(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        require(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        require(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        require(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        require(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        require(
            -2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
        )
        require(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            f"logprobs must be an integer in [0, 20], got {self.logprobs!r}",
        )
        require(
            self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
            f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}",
        )
        require(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be ints >= 0")
        require(all(token >= 0 for token in self.logit_bias), "logit_bias keys must be token ids >= 0")
        require(
            all(-100.0 <= bias <= 100.0 for bias in self.logit_bias.values()), "logit_bias values must be in [-100, 100]"
        )
        if self.structured_output is not None:
            # Beam search ranks whole distributions across beams; a grammar per beam would need its matcher
            # forked and dropped with every beam reshuffle. Refused rather than half-done.
            require(not self.use_beam_search, "beam search does not combine with structured output")
            # Both would ban eos where the grammar allows nothing else, leaving no token to pick.
            require(not self.ignore_eos, "ignore_eos does not combine with structured output")
            require(self.min_tokens == 0, "min_tokens does not combine with structured output")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs at once: its beams, or its n / best_of samples."""
        if self.use_beam_search:
            return self.beam_width
        return self.best_of or self.n
