"""How many tokens a prompt may take: the model's context less the answer's room.

Tokens are estimated from characters. The rule: ceil(chars / CHARS_PER_TOKEN) with 3.0
characters a token, an upper bound for source code and English under the tokenizers of
current models (OpenAI's o200k/cl100k give about 3.5-4 on this project's kernels; older
32k-vocabulary tokenizers about 3). Once a model has answered, the ratio its server reported
(prompt characters / prompt_tokens, less 5%) replaces the rule for that model.
"""
from __future__ import annotations

import dataclasses
import math

CHARS_PER_TOKEN = 3.0
DEFAULT_CONTEXT_TOKENS = 32768         # a model whose context neither config nor server gives
OVERHEAD_TOKENS = 200                  # chat template and role markers around the messages
CALIBRATION_MARGIN = 0.95
MIN_CHARS_PER_TOKEN, MAX_CHARS_PER_TOKEN = 1.5, 6.0


def estimate_tokens(chars: int, chars_per_token: float = CHARS_PER_TOKEN) -> int:
    """Returns the estimated tokens of a text of `chars` characters."""
    return math.ceil(chars / chars_per_token)


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    """A call's split of the model's context: the prompt's share and the answer's."""

    context_tokens: int
    prompt_tokens: int                 # the most the prompt may take (estimated)
    answer_tokens: int                 # sent as max_tokens (max_completion_tokens)
    chars_per_token: float = CHARS_PER_TOKEN

    @property
    def prompt_chars(self) -> int:
        return int(self.prompt_tokens * self.chars_per_token)

    def estimate(self, chars: int) -> int:
        """Returns the estimated tokens of `chars` characters for this model."""
        return estimate_tokens(chars, self.chars_per_token)


def split_context(context_tokens: int, max_tokens: int,
                  chars_per_token: float = CHARS_PER_TOKEN) -> TokenBudget:
    """Returns the budget of a call: the answer gets max_tokens, at most half the context."""
    answer = max(1, min(max_tokens, context_tokens // 2))
    prompt = max(context_tokens - answer - OVERHEAD_TOKENS, 0)
    return TokenBudget(context_tokens, prompt, answer, chars_per_token)


def calibrated(prompt_chars: int, prompt_tokens: int) -> float | None:
    """Returns the characters a token a server's count implies (with a margin), or None."""
    if prompt_tokens <= 0 or prompt_chars <= 0:
        return None
    ratio = prompt_chars / prompt_tokens * CALIBRATION_MARGIN
    return min(max(ratio, MIN_CHARS_PER_TOKEN), MAX_CHARS_PER_TOKEN)
