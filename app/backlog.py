"""How long queued work will take, from the engine's measured speed: what admission by time decides on
(`max_queue_ms`), and what a 429's Retry-After says."""
from __future__ import annotations

import math

_WEIGHT = 0.2  # of the newest batch in the running averages: the speed follows load within a few batches


class EngineSpeed:
    """Real (unpadded) tokens per second of the whole engine, as batches finish. Each finished batch
    stands for the wall time since the previous one finished, or since it started when the engine was idle
    before it: with batches running side by side this is throughput, not one batch's speed. (The batcher
    leaves out small batches whose work came to an idle slot: their time is mostly the engine's fixed cost.)"""

    def __init__(self):
        self._tokens = 0.0  # running averages of a batch's tokens and of the time it stands for
        self._seconds = 0.0
        self._assumed = False  # the averages are assume()'s, until the first batch finishes

    def assume(self, tokens: int, seconds: float) -> None:
        """A speed to go by until the first batch finishes, which then replaces it rather than joins it
        (the start-up batch is larger than most, so it would weigh on the averages for many batches)."""
        if tokens > 0 and seconds > 0 and not self.measured:
            self._tokens, self._seconds, self._assumed = float(tokens), seconds, True

    def batch_finished(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if self._tokens == 0 or self._assumed:
            self._tokens, self._seconds, self._assumed = float(tokens), seconds, False
        else:
            self._tokens += _WEIGHT * (tokens - self._tokens)
            self._seconds += _WEIGHT * (seconds - self._seconds)

    @property
    def measured(self) -> bool:
        return self._tokens > 0

    def seconds_for(self, tokens: int) -> float:
        """Time to run `tokens` at the measured speed; 0 before any batch finished."""
        return tokens * self._seconds / self._tokens if self._tokens else 0.0


def retry_after_s(wait_s: float) -> int:
    """Retry-After (whole seconds, at least 1) for a backlog that clears in `wait_s`."""
    return max(1, math.ceil(wait_s))
