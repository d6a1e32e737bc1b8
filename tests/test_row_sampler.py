"""The host's row sampler (cllm/llama/row_sampler.c through _core.RowSampler): for fixed logits, its
draws follow the distribution the parameters define, computed here the plain way (sort,
softmax, cumulative sums) in llama.cpp's order: penalties, top-k, top-p, min-p, temperature."""
import math
from array import array

import numpy as np
import pytest
from cllm.llama._core import RowSampler


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The probabilities each token is drawn with."""
    x = np.asarray(logits, dtype=np.float64)
    keep = np.isfinite(x)
    best = x[keep].max()
    if top_k > 0:
        ranked = np.sort(x[keep])[::-1]
        keep &= x >= ranked[min(top_k, len(ranked)) - 1]
    if top_p < 1.0:
        order = np.argsort(-np.where(keep, x, -np.inf), kind="stable")[:keep.sum()]
        p = np.exp(x[order] - best)
        cumulative = np.cumsum(p / p.sum())
        last = int(np.searchsorted(cumulative, top_p))  # the first prefix reaching top_p
        keep &= x >= x[order[min(last, len(order) - 1)]]
    if min_p > 0.0:
        keep &= x >= best + math.log(min_p)
    w = np.where(keep, np.exp((np.where(keep, x, best) - best) / temperature), 0.0)
    return w / w.sum()


def penalised(logits, history, repeat=1.0, presence=0.0, frequency=0.0):
    """llama.cpp's penalties over the tokens of `history`."""
    x = np.asarray(logits, dtype=np.float64).copy()
    for token in set(history):
        count = history.count(token)
        x[token] = x[token] * repeat if x[token] <= 0 else x[token] / repeat
        x[token] -= count * frequency + presence
    return x


def draw(sampler, logits, n, banned=()):
    row = array("f", logits)
    counts = np.zeros(len(logits), dtype=np.int64)
    for _ in range(n):
        counts[sampler.sample(row[:], banned)] += 1  # a copy: sampling changes the row
    return counts


def assert_follows(counts, expected, bins=None):
    """Each token's count (or each bin's, bins: lists of tokens) within 5 standard deviations
    of its expectation, and no token drawn that has probability 0."""
    n = counts.sum()
    assert counts[expected == 0].sum() == 0, "a token outside the distribution was drawn"
    for tokens in bins or [[t] for t in range(len(counts))]:
        p = expected[tokens].sum()
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(counts[tokens].sum() - n * p) <= 5 * sigma + 1, (tokens, counts[tokens], n * p)


SMALL = np.random.default_rng(0).normal(0.0, 2.0, 40).astype(np.float32)

PARAMS = [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.5},
    {"temperature": 0.7, "top_p": 0.95},
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 1.3, "top_k": 12, "top_p": 0.8},
    {"temperature": 0.8, "min_p": 0.05},
    {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "min_p": 0.02},
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_draws_follow_the_distribution(params):
    sampler = RowSampler(len(SMALL), seed=1, **params)
    assert_follows(draw(sampler, SMALL, 20_000), reference(SMALL, **params))


# A vocabulary past the sampler's window (1,024 tokens), so that its floors are found by
# bisection before the selection: a peaked head over a long tail, as a model's logits are.
LARGE = np.concatenate([np.random.default_rng(1).normal(0.0, 1.5, 49_000),
                        np.random.default_rng(2).normal(6.0, 1.0, 152)]).astype(np.float32)
LARGE_PARAMS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.95},
    {"temperature": 1.0, "top_p": 0.5},
    {"temperature": 0.8, "top_k": 40},
    {"temperature": 1.0, "top_k": 3000},
    {"temperature": 1.0, "top_k": 2000, "top_p": 0.9},
    {"temperature": 0.9, "min_p": 0.1},
]


@pytest.mark.parametrize("params", LARGE_PARAMS,
                         ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_a_large_vocabulary_keeps_exactly_the_filtered_tokens(params):
    """The row left behind holds the drawn distribution: its finite entries are exactly the
    tokens the filters keep, and its log-softmax the reference's log-probabilities."""
    row = array("f", LARGE)
    RowSampler(len(LARGE), seed=3, keep_distribution=True, **params).sample(row)
    expected = reference(LARGE, **params)
    kept = np.isfinite(np.asarray(row))
    assert np.array_equal(kept, expected > 0)
    x = np.asarray(row, dtype=np.float64)[kept]
    log_softmax = x - x.max() - np.log(np.exp(x - x.max()).sum())
    assert np.allclose(log_softmax, np.log(expected[kept]), atol=1e-4)


@pytest.mark.parametrize("params", LARGE_PARAMS[:4],
                         ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_a_large_vocabulary_draws_follow_the_distribution(params):
    expected = reference(LARGE, **params)
    head = list(np.argsort(-expected)[:15])
    rest = [t for t in range(len(LARGE)) if expected[t] > 0 and t not in set(head)]
    sampler = RowSampler(len(LARGE), seed=4, **params)
    assert_follows(draw(sampler, LARGE, 6_000), expected, bins=[[t] for t in head] + [rest])


def test_penalties_change_the_distribution_as_llama_cpp_does():
    history = [3, 3, 7, 11, 3, 20]
    penalties = {"repeat_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.2}
    expected = reference(penalised(SMALL, history, 1.3, 0.4, 0.2), temperature=0.9)
    counts = np.zeros(len(SMALL), dtype=np.int64)
    row = array("f", SMALL)
    for seed in range(8_000):  # a fresh sampler a draw: each draw joins the history
        sampler = RowSampler(len(SMALL), temperature=0.9, seed=seed, history=history,
                             **penalties)
        counts[sampler.sample(row[:])] += 1
    assert_follows(counts, expected)


def test_penalties_count_only_the_latest_tokens():
    logits = np.zeros(8, dtype=np.float32)
    logits[2] = 1.0
    # token 2 was seen, but before the last 3 tokens: no penalty, so it stays the greedy choice
    sampler = RowSampler(8, temperature=0.0, presence_penalty=5.0, penalty_last_n=3,
                         history=[2, 4, 5, 6])
    assert sampler.sample(array("f", logits)) == 2
    sampler = RowSampler(8, temperature=0.0, presence_penalty=5.0, penalty_last_n=3,
                         history=[4, 2, 5])
    assert sampler.sample(array("f", logits)) != 2


def test_a_seed_repeats_its_draws_and_another_seed_does_not():
    row = array("f", LARGE)

    def draws(seed):
        sampler = RowSampler(len(LARGE), temperature=1.0, top_p=0.95, seed=seed)
        return [sampler.sample(row[:]) for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_banned_tokens_are_never_drawn():
    best = [int(t) for t in np.argsort(-SMALL)[:3]]
    expected = reference(np.where(np.isin(np.arange(len(SMALL)), best), -np.inf, SMALL))
    sampler = RowSampler(len(SMALL), temperature=1.0, seed=5)
    assert_follows(draw(sampler, SMALL, 10_000, banned=best), expected)


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.0},
                                    {"temperature": 0.8, "top_k": 3, "top_p": 0.5}])
def test_a_row_that_allows_no_token_draws_none(params):
    sampler = RowSampler(4, seed=1, **params)
    assert sampler.sample(array("f", [-math.inf] * 4)) == -1
    assert sampler.sample(array("f", [0.5, -math.inf, 2.0, -math.inf]), banned=[0, 2]) == -1


def test_a_token_whose_logit_is_minus_infinity_is_never_drawn_at_any_temperature():
    sampler = RowSampler(4, temperature=100.0, seed=9)
    drawn = {sampler.sample(array("f", [-math.inf, 0.0, -math.inf, -50.0])) for _ in range(400)}
    assert drawn == {1, 3}


def test_the_logits_must_match_the_vocabulary():
    with pytest.raises(ValueError):
        RowSampler(5).sample(array("f", [0.0] * 4))
    with pytest.raises(ValueError):
        RowSampler(5).sample(array("f", [0.0] * 5), banned=[5])
