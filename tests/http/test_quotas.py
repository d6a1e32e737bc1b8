"""Per-key quotas (cllm/http/quotas.py): sequences in flight and tokens a minute, on a clock the
test moves. No model needed."""
import pytest

from cllm.config import ApiKey
from cllm.errors import APIError
from cllm.http.quotas import Quotas


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def refused(quotas, key, sequences=1) -> APIError:
    with pytest.raises(APIError) as caught:
        quotas.admit(key, sequences)
    assert caught.value.status == 429 and caught.value.code == "rate_limit_exceeded"
    return caught.value


def test_sequences_in_flight_are_capped_and_freed_as_they_end():
    quotas, key = Quotas(), ApiKey("k", "agents", max_requests=3)
    quotas.admit(key, 2)
    assert "3 sequences in flight" in refused(quotas, key, 2).message  # n=2 would be 4
    quotas.admit(key, 1)
    refused(quotas, key)
    quotas.ended(key, 10)
    quotas.admit(key, 1)


def test_tokens_a_minute_refuse_until_the_window_frees_them():
    clock = Clock()
    quotas, key = Quotas(clock), ApiKey("k", "batch", tokens_per_minute=1000)
    for tokens in (600, 500):
        quotas.admit(key, 1)
        quotas.ended(key, tokens)
        clock.now += 10
    error = refused(quotas, key)  # 1,100 in the last minute
    assert "1000 tokens a minute" in error.message
    assert error.headers["Retry-After"] == "40"  # when the 600 leave the window
    clock.now += 40
    quotas.admit(key, 1)


def test_unnamed_keys_and_keys_without_limits_are_never_refused():
    quotas = Quotas()
    for key in (None, ApiKey("k"), ApiKey("k2", "alice")):
        for _ in range(100):
            quotas.admit(key, 4)
