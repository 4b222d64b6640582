"""Per-model running averages that turn a request body into token counts (shared by the policies that weigh work)."""

from __future__ import annotations

from .base import Outcome, RequestInfo


class Sizes:
    """- ``token_ratio``: usage.prompt_tokens / our chars-per-4 estimate.
    - ``fill``: completion_tokens / max_tokens, when the client set max_tokens.
    - ``out_avg``: completion_tokens, for requests without max_tokens.
    """

    __slots__ = ("token_ratio", "fill", "out_avg", "tokens_avg")

    def __init__(self) -> None:
        self.token_ratio = 1.0
        self.fill = 1.0
        self.out_avg = 256.0
        self.tokens_avg = 512.0  # prompt + completion per request

    def prompt(self, req: RequestInfo) -> float:
        return req.prompt_tokens * self.token_ratio

    def output(self, req: RequestInfo) -> float:
        if req.max_tokens is not None:
            return max(1.0, min(req.max_tokens * self.fill, float(req.max_tokens)))
        return self.out_avg

    def learn(self, req: RequestInfo, outcome: Outcome, a: float = 0.05) -> None:
        if outcome.prompt_tokens and req.prompt_tokens > 1:
            self.token_ratio += a * (outcome.prompt_tokens / req.prompt_tokens - self.token_ratio)
        ct = outcome.completion_tokens
        if ct is not None and ct >= 0:
            if req.max_tokens:
                self.fill += a * (min(1.0, ct / req.max_tokens) - self.fill)
            else:
                self.out_avg += a * (ct - self.out_avg)
            self.tokens_avg += a * ((outcome.prompt_tokens or self.prompt(req)) + ct - self.tokens_avg)


class SizesByModel(dict[str, Sizes]):
    """Bounded by the models the pool serves (a request for an unknown model is refused before)."""

    def __missing__(self, model: str) -> Sizes:
        s = self[model] = Sizes()
        return s
