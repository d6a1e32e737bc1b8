"""cllm.llama._core with the real models: loading, tokens, the batch step, sampling, KV
bookkeeping."""
import math
import random
import re
import threading
import time
from array import array

import pytest
from model_facts import ENDS_AT_ONCE, ON_GPU_NOT_BATCH_INVARIANT

from cllm.engine.textstream import TextStream
from cllm.llama import _core

PROMPTS = ["1+1=", "2+2=", "3+3=", "The capital of France is", "Once upon a time",
           "def fibonacci(n):", "Water boils at", "My favourite colour is"]


def ints(values):
    return array("i", values)


@pytest.fixture(scope="module")
def ctx(model):
    return _core.Context(model, n_ctx=16 * 512, n_seq_max=16, n_batch=512, kv_unified=False)


def prefill_together(ctx, model, prompts, seq_ids, **sampling):
    """All prompts in one step (greedy unless `sampling` says otherwise): (each one's first
    token, the position of its next one)."""
    prompt_tokens = [model.tokenize(p) for p in prompts]
    for seq_id in seq_ids:
        ctx.set_sampler(seq_id, **sampling)
    flat = [t for tokens in prompt_tokens for t in tokens]
    first = ctx.step(ints(seq_ids), ints([0] * len(prompts)), ints([len(t) for t in prompt_tokens]),
                     ints([1] * len(prompts)), ints(flat))
    return first, [len(t) for t in prompt_tokens]


def generate_together(ctx, model, prompts, n_tokens, seq_ids=None, **sampling):
    """Continuations of all prompts decoded in shared batches (greedy unless `sampling` says
    otherwise); removes the sequences."""
    seq_ids = seq_ids or list(range(len(prompts)))
    last, positions = prefill_together(ctx, model, prompts, seq_ids, **sampling)
    outputs = [[t] for t in last]
    for _ in range(n_tokens - 1):
        last = ctx.step(ints(seq_ids), ints(positions), ints([1] * len(prompts)),
                        ints([1] * len(prompts)), last)
        for out, token in zip(outputs, last):
            out.append(token)
        positions = [p + 1 for p in positions]
    for seq_id in seq_ids:
        ctx.remove_sequence(seq_id)
    return outputs


def test_model_facts(model):
    assert model.n_vocab == 49152
    assert model.n_ctx_train == 8192
    assert model.is_eog(model.eos_token)
    assert model.eog_tokens == tuple(t for t in range(model.n_vocab) if model.is_eog(t))
    assert model.eos_token in model.eog_tokens
    assert not model.is_eog(model.tokenize("hello", add_special=False)[0])
    assert "<|im_start|>" in model.chat_template
    assert model.metadata["general.architecture"] == "llama"


def test_fim_tokens(model):
    """SmolLM2's vocabulary names a repository token (<reponame>) but has no prefix, suffix or
    middle token: llama.cpp finds none, so it cannot fill in the middle."""
    fim = model.fim_tokens
    assert (fim.prefix, fim.suffix, fim.middle) == (-1, -1, -1)
    assert fim.repo == model.tokenize("<reponame>", add_special=False, parse_special=True)[0]


def test_tokenize_round_trip(model):
    text = "Hello, world! Ünïcödé and 日本語 and emoji 🎉."
    tokens = model.tokenize(text, add_special=False)
    assert model.detokenize(tokens) == text
    special = model.tokenize("<|im_start|>user", add_special=False, parse_special=True)
    assert len(special) < len(model.tokenize("<|im_start|>user", add_special=False))


# Special-token text and its ids as llama.cpp's partition gives them (vendor/patches/
# llama-vocab-special-partition-linear.patch must keep them): adjacent special tokens, a text
# starting or ending with one, partial and nested look-alikes.
SPECIAL_TOKEN_TEXTS = {
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n":
        [1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198],
    "<|im_end|><|im_end|>a<|endoftext|> b <|im_start|>": [2, 2, 81, 0, 278, 216, 1],
    "x<|im_start|><|im_end|>  <|endoftext|>\n": [104, 1, 2, 256, 0, 198],
}
SPECIAL_IDS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}


@pytest.mark.parametrize("text", SPECIAL_TOKEN_TEXTS)
def test_special_token_text_keeps_its_ids(model, text):
    assert model.tokenize(text, add_special=False, parse_special=True) == \
        SPECIAL_TOKEN_TEXTS[text]


def test_special_token_text_is_its_pieces_tokenized_alone(model):
    """Thousands of special tokens among text and look-alikes ("<|im_end|", "<<|im_end|>>"):
    the ids are each special token's and each piece between them tokenized on its own."""
    rng = random.Random(0)
    pieces = [*SPECIAL_IDS, "a", " b", "\n", "hello world", "  ", "<|im_", "|>", "é",
              "<|im_end|", "<<|im_end|>>", "\t", "12"]
    text = "".join(rng.choice(pieces) for _ in range(3000))
    expected = []
    for part in re.split("(" + "|".join(map(re.escape, SPECIAL_IDS)) + ")", text):
        if part in SPECIAL_IDS:
            expected.append(SPECIAL_IDS[part])
        elif part:
            expected += model.tokenize(part, add_special=False)
    assert model.tokenize(text, add_special=False, parse_special=True) == expected


def test_utf8_split_across_tokens_round_trips(model):
    text = "Grüße 🎉🚀 日本語のテキスト ✓"
    tokens = model.tokenize(text, add_special=False)
    pieces = [model.token_to_piece(t) for t in tokens]
    split = [p for p in pieces if not _valid_utf8(p)]
    assert split, "the test needs a character that spans tokens"
    stream = TextStream()
    emitted = [stream.feed(p) for p in pieces]
    assert all("\ufffd" not in e for e in emitted)
    assert "".join(emitted) + stream.flush() == text


def _valid_utf8(data):
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@ON_GPU_NOT_BATCH_INVARIANT
def test_three_in_a_row_then_five_at_once_are_independent(ctx, model):
    alone = {p: generate_together(ctx, model, [p], 12)[0] for p in PROMPTS[:5]}
    for p in PROMPTS[:3]:  # the seed server's failure: the 2nd request failed, the 3rd crashed
        assert generate_together(ctx, model, [p], 12)[0] == alone[p]
    together = generate_together(ctx, model, PROMPTS[:5], 12)
    assert together == [alone[p] for p in PROMPTS[:5]]
    assert "2" in model.detokenize(alone["1+1="])
    assert len({tuple(v) for v in alone.values()}) == 5


@ON_GPU_NOT_BATCH_INVARIANT
def test_greedy_alone_equals_greedy_among_fifteen_others(ctx, model):
    target = "The capital of France is"
    alone = generate_together(ctx, model, [target], 32)[0]
    others = [f"Story number {i}: the" for i in range(15)]
    crowded = generate_together(ctx, model, others + [target], 32)
    assert crowded[-1] == alone
    assert "Paris" in model.detokenize(alone)


def decode_logprobs_of_last(ctx, model, prompts, seq_ids):
    """The top-5 logprobs of the last prompt's first decode row, computed in one step with the
    other prompts' decode rows (after one prefill step of them all); removes the sequences."""
    n = len(prompts)
    first, positions = prefill_together(ctx, model, prompts, seq_ids)
    _, lp = ctx.step(ints(seq_ids), ints(positions), ints([1] * n), ints([1] * n), first,
                     ints([-1] * (n - 1) + [5]))
    for seq_id in seq_ids:
        ctx.remove_sequence(seq_id)
    return lp.row(n - 1)


@ON_GPU_NOT_BATCH_INVARIANT
def test_a_decode_row_alone_and_among_fifteen_others_has_the_same_logprobs(ctx, model):
    """Bit for bit, not only the same argmax: a row alone goes through ggml's one-row dot
    products, among others through the tiled matrix products (for the default model's Q4_1
    weights, vendor/patches/ggml-cpu-q4_1-tiles.patch), which must sum in the same order."""
    target = "The capital of France is"
    alone = decode_logprobs_of_last(ctx, model, [target], [0])
    others = [f"Story number {i}: the" for i in range(15)]
    crowded = decode_logprobs_of_last(ctx, model, others + [target], list(range(16)))
    assert crowded == alone
    assert len(alone[1]) == 5


@ON_GPU_NOT_BATCH_INVARIANT
def test_a_decode_row_past_512_cells_alone_and_beside_another_has_the_same_logprobs(model):
    """ggml's flash attention splits a lone one-row query's cells among the threads from 512
    cells on and adds the parts up in another order than row by row, which it computes beside
    other streams' rows: greedy texts past ~256 tokens then changed with a prefix-cache hit or
    with n > 1 (vendor/patches/ggml-cpu-flash-attn-unsplit-kv.patch)."""
    ctx = _core.Context(model, n_ctx=2 * 1024, n_seq_max=2, n_batch=512, n_threads=2,
                        kv_unified=False)
    tokens = model.tokenize(" ".join(f"item {i} is on shelf {i % 7}." for i in range(90)))
    assert len(tokens) > 600
    for start in range(0, len(tokens) - 1, 512):  # all but the last, in pieces a step fits
        piece = tokens[start:min(start + 512, len(tokens) - 1)]
        ctx.step(ints([0]), ints([start]), ints([len(piece)]), ints([0]), ints(piece))
    last, end = tokens[-1:], len(tokens) - 1
    _, alone = ctx.step(ints([0]), ints([end]), ints([1]), ints([1]), ints(last), ints([5]))
    ctx.share_prefix(0, 0, end)  # back to before that row
    beside = model.tokenize("Another stream")
    ctx.step(ints([1]), ints([0]), ints([len(beside)]), ints([0]), ints(beside))
    _, both = ctx.step(ints([0, 1]), ints([end, len(beside)]), ints([1, 1]), ints([1, 1]),
                       ints(last + [beside[-1]]), ints([5, -1]))
    assert both.row(0) == alone.row(0)


def test_removed_ids_are_reused_with_clean_state(ctx, model):
    first = generate_together(ctx, model, ["Once upon a time"], 8, seq_ids=[7])[0]
    generate_together(ctx, model, ["Water boils at"], 8, seq_ids=[7])
    assert generate_together(ctx, model, ["Once upon a time"], 8, seq_ids=[7])[0] == first


def test_thousand_sequences_leave_no_kv_cells(ctx, model):
    tokens = model.tokenize("A short prompt for the churn test")
    for i in range(1000):
        seq_id = i % ctx.n_seq_max
        ctx.set_sampler(seq_id)
        last = ctx.step(ints([seq_id]), ints([0]), ints([len(tokens)]), ints([1]), ints(tokens))
        ctx.step(ints([seq_id]), ints([len(tokens)]), ints([1]), ints([1]), last)
        assert ctx.seq_pos_max(seq_id) == len(tokens)
        ctx.remove_sequence(seq_id)
    assert ctx.kv_cells_used() == 0
    assert all(ctx.seq_pos_max(s) == -1 for s in range(ctx.n_seq_max))


def test_seeded_sampling_is_reproducible(ctx, model):
    def sample(seed):
        return generate_together(ctx, model, ["Once upon a time"], 25, seq_ids=[3],
                                 temperature=1.0, top_p=0.95, top_k=50, seed=seed)[0]

    assert sample(42) == sample(42)
    assert sample(42) != sample(43)


def test_seeded_sampling_in_the_graph_is_reproducible(graph_ctx, model):
    """A row with a temperature alone draws in the decode's graph, from its own generator."""
    def sample(seed):
        return generate_together(graph_ctx, model, ["Once upon a time"], 25, seq_ids=[3],
                                 temperature=1.0, seed=seed)[0]

    assert sample(42) == sample(42)
    assert sample(42) != sample(43)


DRAW_PROMPT = "The capital of France is"


def next_token_probabilities(context, model, k):
    """The k most likely next tokens of DRAW_PROMPT and their probabilities, best first."""
    prompt = model.tokenize(DRAW_PROMPT)
    context.set_sampler(0, host_logits=True)
    _, logprobs = context.step(ints([0]), ints([0]), ints([len(prompt)]), ints([1]),
                               ints(prompt), top_logprobs=ints([k]))
    context.remove_sequence(0)
    return [(token, math.exp(lp)) for token, lp in logprobs.row(0)[1]]


def first_tokens_drawn(context, model, rounds, seed_base, **sampling):
    """How often each token is DRAW_PROMPT's next, over steps of 8 rows of it, each row with
    its own seed."""
    prompt = model.tokenize(DRAW_PROMPT)
    counts, n_rows = {}, 8
    for round_ in range(rounds):
        for s in range(n_rows):
            context.set_sampler(s, seed=seed_base + round_ * n_rows + s, **sampling)
        out = context.step(ints(range(n_rows)), ints([0] * n_rows), ints([len(prompt)] * n_rows),
                           ints([1] * n_rows), ints(prompt * n_rows))
        for s in range(n_rows):
            counts[out[s]] = counts.get(out[s], 0) + 1
            context.remove_sequence(s)
    return counts


def assert_within_5_sigma(drawn, n, p, context):
    assert abs(drawn - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1, context


def test_a_row_drawn_in_the_graph_follows_its_distribution(graph_ctx, model):
    """The graph's draws at temperature 1 land on the prompt's next tokens as often as their
    probabilities say: the three most likely and the rest, each within 5 standard
    deviations."""
    top = next_token_probabilities(graph_ctx, model, 3)
    counts = first_tokens_drawn(graph_ctx, model, 96, 0, temperature=1.0)
    n = sum(counts.values())
    bins = [(counts.get(token, 0), p) for token, p in top]
    bins.append((n - sum(c for c, _ in bins), 1.0 - sum(p for _, p in top)))
    for drawn, p in bins:
        assert_within_5_sigma(drawn, n, p, bins)


@pytest.mark.parametrize("params", [{"temperature": 1.0, "top_k": 3},
                                    {"temperature": 2.0, "top_k": 2},
                                    {"temperature": 1.0, "top_p": 0.8},
                                    {"temperature": 1.0, "top_p": 0.0},
                                    {"temperature": 0.7, "min_p": 0.05}],
                         ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_rows_with_filters_drawn_on_the_device_follow_their_distribution(graph_ctx, model,
                                                                        params):
    """With backend sampling, a row with top-k, top-p or min-p (and no penalty) is drawn on
    the device after the step: only tokens the filters keep come out (computed here from the
    prompt's six most likely tokens, all the filters keep), each as often as its probability at
    the row's temperature says, within 5 standard deviations."""
    ranked = next_token_probabilities(graph_ctx, model, 6)
    kept = ranked[:params.get("top_k", 6)]
    kept = [(t, p) for i, (t, p) in enumerate(kept)  # top-p: while the mass before is under p
            if i == 0 or sum(q for _, q in kept[:i]) < params.get("top_p", 1.0)]
    kept = [(t, p) for t, p in kept if p >= params.get("min_p", 0.0) * ranked[0][1]]
    weights = {t: p ** (1.0 / params["temperature"]) for t, p in kept}
    counts = first_tokens_drawn(graph_ctx, model, 60, 1000 * len(repr(params)), **params)
    assert graph_ctx.device_filters  # drawn on the device, not after a failure on the host
    assert set(counts) <= set(weights)
    n, total = sum(counts.values()), sum(weights.values())
    for token, weight in weights.items():
        assert_within_5_sigma(counts.get(token, 0), n, weight / total, (counts, weights))


def test_penalties_change_greedy_output(ctx, model):
    prompt = "Repeat after me: la la la la la la la"

    def greedy(**penalties):
        return generate_together(ctx, model, [prompt], 11, seq_ids=[4], temperature=0.0,
                                 history=model.tokenize(prompt), **penalties)[0]

    assert greedy() != greedy(repeat_penalty=1.8, presence_penalty=1.5)


def test_logprobs(ctx, model):
    tokens = model.tokenize("The capital of France is")
    ctx.set_sampler(5)
    sampled, lp = ctx.step(ints([5]), ints([0]), ints([len(tokens)]), ints([1]), ints(tokens),
                           ints([5]))
    ctx.remove_sequence(5)
    chosen, top = lp.row(0)
    assert len(top) == 5
    assert top[0][0] == sampled[0] and math.isclose(top[0][1], chosen, abs_tol=1e-5)
    assert [t[1] for t in top] == sorted((t[1] for t in top), reverse=True)
    assert 0.0 < sum(math.exp(t[1]) for t in top) <= 1.0 + 1e-5


def test_ban_eog_greedy_continues_where_the_model_would_end(ctx, model):
    (free,) = generate_together(ctx, model, [ENDS_AT_ONCE], 1, seq_ids=[6])
    assert model.is_eog(free[0])
    (banned,) = generate_together(ctx, model, [ENDS_AT_ONCE], 12, seq_ids=[6], ban_eog=True)
    assert not any(model.is_eog(t) for t in banned)
    assert model.detokenize(banned).strip()


def test_ban_eog_holds_for_sampled_sequences(ctx, model):
    def first_tokens(**ban):
        return [generate_together(ctx, model, [ENDS_AT_ONCE], 1, seq_ids=[7], temperature=1.0,
                                  seed=seed, **ban)[0][0] for seed in range(12)]

    assert any(model.is_eog(t) for t in first_tokens())
    assert not any(model.is_eog(t) for t in first_tokens(ban_eog=True))


def test_greedy_rows_sampled_in_parallel_take_each_rows_best_token(ctx, model):
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS * 2)]
    tokens = [model.tokenize(p) for p in prompts]
    for seq_id in range(len(prompts)):
        ctx.set_sampler(seq_id, ban_eog=seq_id % 2 == 1)
    sampled, lp = ctx.step(ints(range(len(prompts))), ints([0] * len(prompts)),
                           ints([len(t) for t in tokens]), ints([1] * len(prompts)),
                           ints([t for row in tokens for t in row]), ints([3] * len(prompts)))
    for seq_id in range(len(prompts)):
        ctx.remove_sequence(seq_id)
    for row, token in enumerate(sampled):
        chosen, top = lp.row(row)
        assert top[0][0] == token and math.isclose(chosen, top[0][1], abs_tol=1e-5)
        if row % 2 == 1:
            assert not model.is_eog(token)


def test_a_step_waits_for_bitmasks_another_thread_is_still_filling(ctx, model):
    """With masks_ready, the masks are written after the step starts; the sampled token must be
    the one token they allow, never what the unfilled (all-zero) buffer would give."""
    tokens = model.tokenize("The capital of France is")
    allowed = 4242
    masks = array("i", bytes(4 * ctx.mask_words))
    ready = array("i", [0])

    def fill_late():
        time.sleep(0.2)
        masks[allowed // 32] = 1 << (allowed % 32) if allowed % 32 < 31 else -(1 << 31)
        ready[0] = 1

    for ban_eog in (False, True):  # greedy argmax, and a sampler chain
        ready[0] = 0
        masks[allowed // 32] = 0
        ctx.set_sampler(7, temperature=0.0 if not ban_eog else 0.8, seed=1, ban_eog=ban_eog)
        filler = threading.Thread(target=fill_late)
        filler.start()
        out = ctx.step(ints([7]), ints([0]), ints([len(tokens)]), ints([1]), ints(tokens),
                       None, ints([0]), masks, ready)
        filler.join()
        ctx.remove_sequence(7)
        assert list(out) == [allowed]


def only(token: int, words: int) -> array:
    """A bitmask that allows `token` alone."""
    mask = array("i", bytes(4 * words))
    mask[token // 32] = 1 << (token % 32) if token % 32 < 31 else -(1 << 31)
    return mask


def test_a_decode_run_advances_constrained_rows_between_its_steps(ctx, model):
    """after_step sees each going-on row's token after every step, the bitmasks it refills
    hold in the next step, and a row it ends stops there while the others run on."""
    tokens = [model.tokenize(p) for p in PROMPTS[:2]]
    firsts, seen = [101, 202, 303], []
    masks = only(firsts[0], ctx.mask_words)

    def after_step(going_on, more):
        seen.append((list(going_on), more))
        if len(seen) < len(firsts):
            masks[:] = only(firsts[len(seen)], ctx.mask_words)
        return [0] if len(seen) == len(firsts) else []

    for seq_id in (0, 1):
        ctx.set_sampler(seq_id, ban_eog=True, host_logits=seq_id == 0)
    first = ctx.step(ints([0, 1]), ints([0, 0]), ints([len(t) for t in tokens]), ints([1, 1]),
                     ints(tokens[0] + tokens[1]))
    run, counts = ctx.decode_run(ints([0, 1]), ints([len(t) for t in tokens]), first,
                                 ints([8, 8]), 8, ints([0, -1]), masks, None, after_step)
    # row 0 holds its prompt, its first token, 101 and 202: not 303, fed before it was ended
    assert ctx.seq_pos_max(0) == len(tokens[0]) + 2
    free = generate_together(ctx, model, PROMPTS[1:2], 9, seq_ids=[5], ban_eog=True)[0]
    for seq_id in (0, 1):
        ctx.remove_sequence(seq_id)
    assert list(counts) == [3, 8]
    assert list(run[:3]) == firsts and list(run[8:16]) == free[1:]
    # -1: the row stopped, ended by after_step (row 0) or by its budget (row 1, last step)
    assert [going_on[0] for going_on, _ in seen] == firsts + [-1] * 5
    assert [going_on[1] for going_on, _ in seen] == free[1:8] + [-1]
    assert [more for _, more in seen] == [True] * 7 + [False]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 3}],
                         ids=["greedy", "sampled"])
def test_a_row_whose_bitmask_allows_no_token_samples_none_and_the_run_goes_on_without_it(
        ctx, model, sampling):
    """A row that may take no token samples -1 (as ggml's CUDA argmax answers in the graph)
    and stops there: fed on, its -1 would make llama.cpp refuse the step for every row."""
    tokens = [model.tokenize(p) for p in PROMPTS[:2]]
    nothing = array("i", bytes(4 * ctx.mask_words))
    ctx.set_sampler(0, ban_eog=True, **sampling)
    ctx.set_sampler(1, ban_eog=True)
    first = ctx.step(ints([0, 1]), ints([0, 0]), ints([len(t) for t in tokens]), ints([1, 1]),
                     ints(tokens[0] + tokens[1]))
    run, counts = ctx.decode_run(ints([0, 1]), ints([len(t) for t in tokens]), first,
                                 ints([6, 6]), 6, ints([0, -1]), nothing, None,
                                 lambda going_on, more: [])
    ends = [ctx.seq_pos_max(0), ctx.seq_pos_max(1)]
    for seq_id in (0, 1):
        ctx.remove_sequence(seq_id)
    assert list(counts) == [1, 6] and run[0] == -1
    assert ends == [len(tokens[0]), len(tokens[1]) + 5]


def test_a_step_row_that_samples_no_token_has_no_logprobs(ctx, model):
    tokens = model.tokenize(PROMPTS[0])
    ctx.set_sampler(3)
    sampled, lp = ctx.step(ints([3]), ints([0]), ints([len(tokens)]), ints([1]), ints(tokens),
                           ints([3]), ints([0]), array("i", bytes(4 * ctx.mask_words)))
    ctx.remove_sequence(3)
    assert list(sampled) == [-1] and lp.row(0)[1] == []


def test_run_timing_counts_the_steps_of_decode_runs_since_it_was_last_read(ctx, model):
    tokens = model.tokenize(PROMPTS[0])
    ctx.set_sampler(4, ban_eog=True)
    first = ctx.step(ints([4]), ints([0]), ints([len(tokens)]), ints([1]), ints(tokens))
    ctx.run_timing()
    ctx.decode_run(ints([4]), ints([len(tokens)]), first, ints([5]), 8)
    timing = ctx.run_timing()
    ctx.remove_sequence(4)
    assert timing["steps"] == 5  # its budget ended the run
    assert timing["decode_ms"] > 0 and timing["sample_ms"] > 0 and timing["after_step_ms"] == 0
    assert 0 <= timing["wait_ms"] < timing["decode_ms"]  # a CPU computes inside llama_decode
    assert ctx.run_timing()["steps"] == 0


def test_decode_steps_of_one_shape_run_on_the_graph_of_the_step_before(ctx, model):
    """llama.cpp builds a graph for a step of a new shape (the prompt, the first decode, a
    piece of 3 tokens) and reuses the one before for a step of the same shape."""
    tokens = model.tokenize(PROMPTS[0])
    ctx.set_sampler(5, ban_eog=True)
    last = ctx.step(ints([5]), ints([0]), ints([len(tokens)]), ints([1]), ints(tokens))
    counts, position = [ctx.graphs_reused], len(tokens)
    for _ in range(4):
        last = ctx.step(ints([5]), ints([position]), ints([1]), ints([1]), last)
        counts.append(ctx.graphs_reused)
        position += 1
    ctx.step(ints([5]), ints([position]), ints([3]), ints([1]), ints(tokens[:3]))
    counts.append(ctx.graphs_reused)
    ctx.remove_sequence(5)
    assert [c - counts[0] for c in counts] == [0, 0, 1, 2, 3, 3]


def test_a_decode_run_that_ends_at_a_stop_ends_after_the_step_where_a_row_stopped(ctx, model):
    """Someone waits for a slot: the run ends where one frees, not when every row stopped."""
    rows, tokens = [1, 3, 6], [model.tokenize(p) for p in PROMPTS[:3]]
    for seq_id in rows:
        ctx.set_sampler(seq_id, ban_eog=True)
    first = ctx.step(ints(rows), ints([0] * 3), ints([len(t) for t in tokens]), ints([1] * 3),
                     ints([t for row in tokens for t in row]))
    out, counts = ctx.decode_run(ints(rows), ints([len(t) for t in tokens]), first,
                                 ints([8, 3, 5]), 8, end_at_stop=True)
    ends = [ctx.seq_pos_max(s) for s in rows]
    for seq_id in rows:
        ctx.remove_sequence(seq_id)
    assert list(counts) == [3, 3, 3]
    assert ends == [len(t) + 2 for t in tokens]  # each row's cells through its last token fed


HELD_ROWS = [0, 2, 5]
HELD_KINDS = [{"ban_eog": True}, {"temperature": 0.9, "seed": 11}, {"host_logits": True}]


def three_rows_in_two_runs(ctx, model, hold):
    """Three rows of HELD_KINDS through a run of 8 steps (budgets 2, 8, 5) and then one of 3:
    each run's tokens and counts, each row's last cell after each run, and the held rows
    counted in the first; removes the sequences."""
    ctx.hold_run_shape = hold
    tokens = [model.tokenize(p) for p in PROMPTS[:3]]
    for seq_id, kind in zip(HELD_ROWS, HELD_KINDS):
        ctx.set_sampler(seq_id, **kind)
    first = ctx.step(ints(HELD_ROWS), ints([0] * 3), ints([len(t) for t in tokens]),
                     ints([1] * 3), ints([t for row in tokens for t in row]))
    ctx.run_timing()
    out, counts = ctx.decode_run(ints(HELD_ROWS), ints([len(t) for t in tokens]), first,
                                 ints([2, 8, 5]), 8)
    held = ctx.run_timing()["held_rows"]
    ends = [ctx.seq_pos_max(s) for s in HELD_ROWS]
    lasts = [out[r * 8 + counts[r] - 1] for r in range(3)]
    again, again_counts = ctx.decode_run(ints(HELD_ROWS), ints([e + 1 for e in ends]),
                                         ints(lasts), ints([3, 3, 3]), 3)
    after = [ctx.seq_pos_max(s) for s in HELD_ROWS]
    for seq_id in HELD_ROWS:
        ctx.remove_sequence(seq_id)
    return {"tokens": made(out, counts, 8), "counts": list(counts), "ends": ends,
            "again": made(again, again_counts, 3), "again_counts": list(again_counts),
            "after": after, "held": held, "prompts": [len(t) for t in tokens]}


def made(out, counts, n_steps):
    """Each row's tokens of a decode run (the rest of `out` is not written)."""
    return [list(out[r * n_steps:r * n_steps + counts[r]]) for r in range(len(counts))]


@ON_GPU_NOT_BATCH_INVARIANT  # held rows change a step's batch size, and CUDA's kernels with it
def test_a_decode_run_that_holds_its_shape_makes_the_same_tokens(model):
    """With hold_run_shape, rows that stop (budget, end token) stay in the run's batch until it
    ends, so each step has the same shape: every row's tokens and its sampler's state (a seeded
    temperature row continues the same in the next run) are as without it. In split streams,
    where a CPU's logits do not depend on the batch: in one pool a held row changes the others'
    logits in their last digits, and a sampled row's draw near a boundary with them."""
    ctx = _core.Context(model, n_ctx=4096, n_seq_max=8, backend_sampling=True, kv_unified=False)
    plain = three_rows_in_two_runs(ctx, model, hold=False)
    held = three_rows_in_two_runs(ctx, model, hold=True)
    assert plain["held"] == 0 and held["held"] > 0
    del plain["held"], held["held"]
    assert held == plain


def test_a_decode_run_that_holds_its_shape_leaves_each_row_its_own_cells(model):
    """What a held row is fed after it stopped leaves no cell: after each run, every row's
    cells end at its last token fed, as the counts say."""
    ctx = _core.Context(model, n_ctx=4096, n_seq_max=8, backend_sampling=True)
    got = three_rows_in_two_runs(ctx, model, hold=True)
    assert got["counts"][0] == 2 and got["held"] > 0
    assert got["ends"] == [p + c - 1 for p, c in zip(got["prompts"], got["counts"])]
    assert got["after"] == [e + c for e, c in zip(got["ends"], got["again_counts"])]


def test_a_decode_run_does_not_hold_a_row_whose_stream_is_full(model):
    """Split streams of 256 cells: a row that stops on its stream's last cell has no cell for
    its next position, so the run goes on with the other row alone instead of failing."""
    ctx = _core.Context(model, n_ctx=4 * 256, n_seq_max=4, kv_unified=False,
                        backend_sampling=True)
    ctx.hold_run_shape = True
    long = (model.tokenize(" ".join(PROMPTS)) * 20)[:250]
    short = model.tokenize(PROMPTS[0])
    for seq_id in (0, 1):
        ctx.set_sampler(seq_id, ban_eog=True)
    first = ctx.step(ints([0, 1]), ints([0, 0]), ints([len(long), len(short)]), ints([1, 1]),
                     ints(long + short))
    _, counts = ctx.decode_run(ints([0, 1]), ints([len(long), len(short)]), first,
                               ints([6, 8]), 8)
    assert ctx.n_ctx_seq == 256 and list(counts) == [6, 8]
    assert [ctx.seq_pos_max(0), ctx.seq_pos_max(1)] == [255, len(short) + 7]


@pytest.mark.parametrize("backend_sampling", [False, True], ids=["host", "graph"])
def test_a_decode_run_over_scattered_split_streams_is_one_pass_and_leaves_idle_ones_as_they_were(
        model, backend_sampling):
    """Rows in streams 0, 3 and 7 with idle streams between them: each step is one forward pass
    (vendor/patches/llama-kv-split-stream-gaps.patch; llama.cpp reuses the step's graph from
    the second step on, where three passes of one row each would never repeat a graph), the
    rows get the tokens they get in consecutive streams, and the idle streams' cells are as
    before: a prompt cached in stream 2 continues as if computed at once."""
    def context():
        return _core.Context(model, n_ctx=8 * 256, n_seq_max=8, kv_unified=False,
                             backend_sampling=backend_sampling)

    scattered, together = context(), context()
    cached = model.tokenize(PROMPTS[5])
    scattered.step(ints([2]), ints([0]), ints([len(cached) - 1]), ints([0]), ints(cached[:-1]))
    used = scattered.kv_cells_used()

    def run(ctx, rows):
        tokens = [model.tokenize(p) for p in PROMPTS[:3]]
        first = []
        for seq_id, prompt in zip(rows, tokens):  # alone, so both contexts compute them alike
            ctx.set_sampler(seq_id, ban_eog=True)
            first += ctx.step(ints([seq_id]), ints([0]), ints([len(prompt)]), ints([1]),
                              ints(prompt))
        first = ints(first)
        reused = ctx.graphs_reused
        out, counts = ctx.decode_run(ints(rows), ints([len(t) for t in tokens]), first,
                                     ints([8] * 3), 8)
        reused = ctx.graphs_reused - reused
        for seq_id in rows:
            ctx.remove_sequence(seq_id)
        return list(out), list(counts), reused

    out, counts, reused = run(scattered, [0, 3, 7])
    assert (out, counts) == run(together, [0, 1, 2])[:2] and counts == [8, 8, 8]
    assert reused >= 6
    assert scattered.kv_cells_used() == used
    assert [scattered.seq_pos_max(s) for s in (1, 2, 4)] == [-1, len(cached) - 2, -1]

    def first_token(ctx, start):  # of the cached prompt, from its position `start`
        ctx.set_sampler(2)
        token = ctx.step(ints([2]), ints([start]), ints([len(cached) - start]), ints([1]),
                         ints(cached[start:]))
        ctx.remove_sequence(2)
        return list(token)

    assert first_token(scattered, len(cached) - 1) == first_token(together, 0)


def test_what_after_step_raises_ends_the_run_and_is_raised(ctx, model):
    tokens = model.tokenize(PROMPTS[0])
    ctx.set_sampler(3, host_logits=True, ban_eog=True)
    first = ctx.step(ints([3]), ints([0]), ints([len(tokens)]), ints([1]), ints(tokens))

    def after_step(going_on, more):
        raise RuntimeError("a matcher broke")

    with pytest.raises(RuntimeError, match="a matcher broke"):
        ctx.decode_run(ints([3]), ints([len(tokens)]), first, ints([8]), 8, ints([0]),
                       array("i", [-1]) * ctx.mask_words, None, after_step)
    assert ctx.seq_pos_max(3) == len(tokens)  # one step ran: it fed the first token
    ctx.remove_sequence(3)


@pytest.fixture(scope="module")
def graph_ctx(model):
    """A context that samples greedy and temperature-only sequences inside llama.cpp's graph
    (backend sampling: the CPU backend runs those samplers too, so this runs here as on a
    GPU)."""
    context = _core.Context(model, n_ctx=4096, n_seq_max=8, kv_unified=True,
                            backend_sampling=True)
    assert context.backend_sampling
    return context




def test_sampling_in_the_graph_gives_the_host_greedy_tokens_beside_host_rows(graph_ctx, model):
    host_ctx = _core.Context(model, n_ctx=4096, n_seq_max=8, kv_unified=True)
    kinds = [{}, {"ban_eog": True}, {"temperature": 0.8, "seed": 3}, {"host_logits": True},
             {}, {"ban_eog": True}]

    def run(context):
        tokens = [model.tokenize(p) for p in PROMPTS[:len(kinds)]]
        for seq_id, kind in enumerate(kinds):
            context.set_sampler(seq_id, **kind)
        rows = ints(range(len(kinds)))
        first = context.step(rows, ints([0] * len(kinds)), ints([len(t) for t in tokens]),
                             ints([1] * len(kinds)), ints([t for row in tokens for t in row]))
        stepped = context.step(rows, ints([len(t) for t in tokens]), ints([1] * len(kinds)),
                               ints([1] * len(kinds)), first)
        run_tokens, counts = context.decode_run(rows, ints([len(t) + 1 for t in tokens]),
                                                stepped, ints([12] * len(kinds)), 12)
        for seq_id in range(len(kinds)):
            context.remove_sequence(seq_id)
        return list(first), list(stepped), list(run_tokens), list(counts)

    assert run(graph_ctx) == run(host_ctx)
    # and when every row samples in the graph, so that no logits reach the host at all
    kinds = [{}, {"ban_eog": True}, {}, {"ban_eog": True}]
    assert run(graph_ctx) == run(host_ctx)
    assert graph_ctx.kv_cells_used() == 0


def test_a_slot_changes_where_it_samples_with_each_sequence(graph_ctx, model):
    """Every slot keeps the sampler attached when the context was made; a sequence that needs
    another kind (host, greedy, greedy without end tokens) gets it, and a parked sampler moves
    along."""
    host_ctx = _core.Context(model, n_ctx=4096, n_seq_max=8, kv_unified=True)
    for kind in ({}, {"temperature": 0.7, "seed": 5}, {"ban_eog": True}, {"host_logits": True},
                 {}):
        expected = generate_together(host_ctx, model, PROMPTS[:2], 8, **kind)
        assert generate_together(graph_ctx, model, PROMPTS[:2], 8, **kind) == expected
    tokens = model.tokenize(PROMPTS[3])
    graph_ctx.set_sampler(0, ban_eog=True)
    first = graph_ctx.step(ints([0]), ints([0]), ints([len(tokens)]), ints([1]), ints(tokens))
    graph_ctx.set_sampler(5, temperature=0.9, seed=1)  # slot 5 samples on the host now
    graph_ctx.share_prefix(5, 0, len(tokens))
    graph_ctx.restore_sampler(5, graph_ctx.park_sampler(0))
    graph_ctx.remove_sequence(0)
    nxt = graph_ctx.step(ints([5]), ints([len(tokens)]), ints([1]), ints([1]), first)
    graph_ctx.remove_sequence(5)
    expected = generate_together(host_ctx, model, [PROMPTS[3]], 2, ban_eog=True)[0]
    assert [first[0], nxt[0]] == expected


def test_rows_the_host_samples_read_their_logits_back_from_the_graph(graph_ctx, model):
    """Beside rows sampled in the graph, a row that wants log-probabilities or a bitmask gets
    them from the logits the graph kept: the same as a context that samples on the host."""
    host_ctx = _core.Context(model, n_ctx=4096, n_seq_max=8, kv_unified=True)
    digits = array("i", [0]) * graph_ctx.mask_words
    for token in model.tokenize("0123456789", add_special=False):
        digits[token // 32] |= 1 << (token % 32)

    def run(context):
        tokens = [model.tokenize(p) for p in PROMPTS[:3]]
        context.set_sampler(0)
        context.set_sampler(1, host_logits=True)
        context.set_sampler(2, host_logits=True)
        out, lp = context.step(ints([0, 1, 2]), ints([0, 0, 0]), ints([len(t) for t in tokens]),
                               ints([1, 1, 1]), ints([t for row in tokens for t in row]),
                               ints([-1, 3, -1]), ints([-1, -1, 0]), digits)
        for seq_id in range(3):
            context.remove_sequence(seq_id)
        return list(out), lp.row(1)

    graph_out, graph_lp = run(graph_ctx)
    host_out, host_lp = run(host_ctx)
    assert graph_out == host_out
    assert model.token_to_piece(graph_out[2]).decode() in "0123456789"
    (graph_chosen, graph_top), (host_chosen, host_top) = graph_lp, host_lp
    assert [t for t, _ in graph_top] == [t for t, _ in host_top] and len(graph_top) == 3
    assert graph_chosen == pytest.approx(host_chosen, abs=1e-4)
    assert [lp for _, lp in graph_top] == pytest.approx([lp for _, lp in host_top], abs=1e-4)


@pytest.mark.parametrize("layout", [{"kv_unified": False}, {"kv_unified": True, "n_ubatch": 8}],
                         ids=["split-streams", "small-micro-batches"])
def test_host_rows_keep_their_logits_across_the_micro_batches_of_a_decode(model, layout):
    """A decode of non-adjacent split streams, or of a batch larger than n_ubatch, runs in
    several micro-batches whose graphs reuse one set of buffers: the rows the host samples
    still get their own logits, not those of a later micro-batch."""
    graph_ctx = _core.Context(model, n_ctx=4096, n_seq_max=8, backend_sampling=True, **layout)
    host_ctx = _core.Context(model, n_ctx=4096, n_seq_max=8, **layout)
    seq_ids = [6, 1, 4, 3]
    kinds = [{"host_logits": True}, {}, {"temperature": 0.8, "seed": 3}, {"ban_eog": True}]

    def run(context):
        tokens = [model.tokenize(p) for p in PROMPTS[:len(seq_ids)]]
        for seq_id, kind in zip(seq_ids, kinds):
            context.set_sampler(seq_id, **kind)
        rows, ones = ints(seq_ids), ints([1] * len(seq_ids))
        first, lp = context.step(rows, ints([0] * len(seq_ids)), ints([len(t) for t in tokens]),
                                 ones, ints([t for row in tokens for t in row]),
                                 ints([2, -1, -1, -1]))
        stepped = context.step(rows, ints([len(t) for t in tokens]), ones, ones, first)
        for seq_id in seq_ids:
            context.remove_sequence(seq_id)
        return list(first), list(stepped), lp.row(0)

    graph_first, graph_next, (graph_chosen, graph_top) = run(graph_ctx)
    host_first, host_next, (host_chosen, host_top) = run(host_ctx)
    assert (graph_first, graph_next) == (host_first, host_next)
    assert [t for t, _ in graph_top] == [t for t, _ in host_top]
    assert graph_chosen == pytest.approx(host_chosen, abs=1e-4)


def test_host_rows_of_adjacent_slots_read_back_together_keep_their_own_logits(model):
    """Host rows come back from the slot table a run of adjacent slots at a time: rows in
    slot order (0, 1, 2 and 6, 7), out of it (5 before 4) and beside a graph row (3) each
    get their own sequence's tokens and log-probabilities."""
    graph_ctx = _core.Context(model, n_ctx=4096, n_seq_max=8, kv_unified=True,
                              backend_sampling=True)
    host_ctx = _core.Context(model, n_ctx=4096, n_seq_max=8, kv_unified=True)
    seq_ids = [0, 1, 2, 5, 4, 3, 6, 7]

    def run(context):
        tokens = [model.tokenize(p) for p in PROMPTS[:len(seq_ids)]]
        for seq_id in seq_ids:
            context.set_sampler(seq_id, host_logits=seq_id != 3)
        first, lp = context.step(ints(seq_ids), ints([0] * len(seq_ids)),
                                 ints([len(t) for t in tokens]), ints([1] * len(seq_ids)),
                                 ints([t for row in tokens for t in row]),
                                 ints([3 if s != 3 else -1 for s in seq_ids]))
        for seq_id in seq_ids:
            context.remove_sequence(seq_id)
        return list(first), [lp.row(r) for r, s in enumerate(seq_ids) if s != 3]

    graph_tokens, graph_lps = run(graph_ctx)
    host_tokens, host_lps = run(host_ctx)
    assert graph_tokens == host_tokens
    assert len(set(graph_tokens)) > 1  # different prompts: a row given another's logits shows
    for (graph_chosen, graph_top), (host_chosen, host_top) in zip(graph_lps, host_lps):
        assert [t for t, _ in graph_top] == [t for t, _ in host_top]
        assert graph_chosen == pytest.approx(host_chosen, abs=1e-4)


@pytest.mark.parametrize("device_masks", [True, False], ids=["device-choice", "host-fallback"])
def test_bitmask_rows_sampled_in_the_graph_choose_among_their_allowed_tokens_as_the_host_does(
        graph_ctx, model, device_masks):
    """Greedy rows sampled in the graph with a bitmask take the device's masked choice (or,
    where that is off, as after it failed, the host's over their logits read back), in a
    step and in a decode run whose after_step refills the bitmasks: the tokens a context that
    samples on the host picks, where the unmasked argmax is mostly forbidden. Beside them, an
    unmasked graph row, a banned end token, a sampled row with a bitmask, and a bitmask that
    allows only the vocabulary's last token (the last word's high bits)."""
    assert graph_ctx.device_masks
    graph_ctx.device_masks = device_masks
    host_ctx = _core.Context(model, n_ctx=4096, n_seq_max=8, kv_unified=True)
    words = graph_ctx.mask_words
    digits = array("i", bytes(4 * words))
    for token in model.tokenize("0123456789", add_special=False):
        digits[token // 32] |= 1 << (token % 32)
    last = only(model.n_vocab - 1, words)
    kinds = [{}, {"ban_eog": True}, {}, {"temperature": 0.8, "seed": 7}, {}]
    mask_rows = ints([0, 1, -1, 0, 2])

    def run(context):
        masks = digits + digits + last
        tokens = [model.tokenize(p) for p in PROMPTS[:len(kinds)]]
        for seq_id, kind in enumerate(kinds):
            context.set_sampler(seq_id, **kind)
        rows = ints(range(len(kinds)))
        first = context.step(rows, ints([0] * len(kinds)), ints([len(t) for t in tokens]),
                             ints([1] * len(kinds)), ints([t for row in tokens for t in row]),
                             None, mask_rows, masks)

        def after_step(going_on, more):  # row 1 next allows only the token after its last
            if going_on[1] >= 0:
                masks[words:2 * words] = only((going_on[1] + 1) % model.n_vocab, words)
            return []

        run_tokens, counts = context.decode_run(rows, ints([len(t) for t in tokens]), first,
                                                ints([6] * len(kinds)), 6, mask_rows, masks,
                                                None, after_step)
        for seq_id in range(len(kinds)):
            context.remove_sequence(seq_id)
        return list(first), list(run_tokens), list(counts)

    try:
        graph_run, host_run = run(graph_ctx), run(host_ctx)
    finally:
        graph_ctx.device_masks = True
    assert graph_run == host_run
    first, run_tokens, _ = graph_run
    assert model.token_to_piece(first[0]).decode() in "0123456789"
    assert first[4] == run_tokens[4 * 6] == model.n_vocab - 1
    assert [run_tokens[6 + i + 1] for i in range(5)] == [t + 1 for t in run_tokens[6:11]]
    assert graph_ctx.kv_cells_used() == 0


def test_a_sequence_sampled_in_the_graph_refuses_logprobs(graph_ctx, model):
    tokens = model.tokenize(PROMPTS[0])
    graph_ctx.set_sampler(1)
    with pytest.raises(ValueError, match="host_logits"):
        graph_ctx.step(ints([1]), ints([0]), ints([len(tokens)]), ints([1]), ints(tokens),
                       ints([2]))
    graph_ctx.set_sampler(1, host_logits=True)
    _, lp = graph_ctx.step(ints([1]), ints([0]), ints([len(tokens)]), ints([1]), ints(tokens),
                           ints([2]))
    graph_ctx.remove_sequence(1)
    assert lp.row(0)[1][0][0] >= 0


def test_prefill_chunks_without_sampling_return_minus_one(ctx, model):
    tokens = model.tokenize("The capital of France is")
    ctx.set_sampler(6)
    first = ctx.step(ints([6]), ints([0]), ints([3]), ints([0]), ints(tokens[:3]))
    assert list(first) == [-1]
    rest = ctx.step(ints([6]), ints([3]), ints([len(tokens) - 3]), ints([1]), ints(tokens[3:]))
    ctx.remove_sequence(6)
    whole = generate_together(ctx, model, ["The capital of France is"], 1)[0]
    assert list(rest) == whole


def test_bad_rows_raise_value_errors(ctx, model):
    with pytest.raises(ValueError, match="seq_id"):
        ctx.step(ints([99]), ints([0]), ints([1]), ints([1]), ints([1]))
    with pytest.raises(ValueError, match="vocabulary"):
        ctx.step(ints([0]), ints([0]), ints([1]), ints([1]), ints([10**6]))
    with pytest.raises(ValueError, match="tokens"):
        ctx.step(ints([0]), ints([0]), ints([2]), ints([1]), ints([1]))
    assert ctx.kv_cells_used() == 0


def test_each_sequence_owns_its_share_unless_unified(ctx, model):
    assert (ctx.n_ctx, ctx.n_ctx_seq, ctx.kv_unified) == (8192, 512, False)
    unified = _core.Context(model, n_ctx=1024, n_seq_max=4, n_batch=64)
    assert (unified.n_ctx, unified.n_ctx_seq, unified.kv_unified) == (1024, 1024, True)


def test_batch_that_does_not_fit_the_cache_is_kv_full(model):
    small = _core.Context(model, n_ctx=256, n_seq_max=2, n_batch=256, kv_unified=True)
    tokens = model.tokenize("word " * 200, add_special=False)[:200]
    small.step(ints([0]), ints([0]), ints([200]), ints([0]), ints(tokens))
    with pytest.raises(_core.KVCacheFullError):
        small.step(ints([1]), ints([0]), ints([200]), ints([1]), ints(tokens))
    assert small.kv_cells_used() == 200  # the failed batch wrote nothing


def test_gil_is_released_during_a_long_prefill(model):
    big = _core.Context(model, n_ctx=2048, n_seq_max=1, n_batch=2048, n_ubatch=512)
    tokens = model.tokenize("The quick brown fox jumps over the lazy dog. " * 140)[:1500]
    ticks, stop = [], threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())

    thread = threading.Thread(target=count)
    thread.start()
    time.sleep(0.05)
    start = time.perf_counter()
    big.step(ints([0]), ints([0]), ints([len(tokens)]), ints([1]), ints(tokens))
    end = time.perf_counter()
    stop.set()
    thread.join()
    during = sum(1 for t in ticks if start < t < end)
    assert during > 1000, f"the other thread ran {during} times in {end - start:.3f} s"


@pytest.mark.parametrize("content, reason", [
    (None, "no such file"),
    (b"NOTGGUF" + bytes(100), "not a GGUF file"),
])
def test_bad_model_files_raise(tmp_path, content, reason):
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(_core.ModelLoadError, match=reason) as info:
        _core.Model(path)
    assert str(path) in str(info.value)


def test_truncated_model_raises(tmp_path, model_path):
    path = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as f:
        path.write_bytes(f.read(5_000_000))
    with pytest.raises(_core.ModelLoadError, match="could not load") as info:
        _core.Model(path)
    assert str(path) in str(info.value)


def test_gemma3_generates(gemma_path):
    gemma = _core.Model(gemma_path)
    assert gemma.metadata["general.architecture"] == "gemma3"
    gctx = _core.Context(gemma, n_ctx=1024, n_seq_max=4, n_batch=256, kv_unified=False)
    out = generate_together(gctx, gemma, ["The capital of France is Paris. The capital of "
                                          "Germany is", "Monday, Tuesday, Wednesday,"], 8)
    assert "Berlin" in gemma.detokenize(out[0])
    assert "Thursday" in gemma.detokenize(out[1])
    assert gctx.kv_cells_used() == 0


def test_a_model_with_a_sliding_window_holds_no_row_in_a_decode_run(gemma_path):
    """Gemma 3's sliding window would count a held row's position: its runs hold nothing."""
    gemma = _core.Model(gemma_path)
    gctx = _core.Context(gemma, n_ctx=1024, n_seq_max=4, backend_sampling=True)
    gctx.hold_run_shape = True
    tokens = [gemma.tokenize(p) for p in PROMPTS[:2]]
    for seq_id in (0, 1):
        gctx.set_sampler(seq_id, ban_eog=True)
    first = gctx.step(ints([0, 1]), ints([0, 0]), ints([len(t) for t in tokens]), ints([1, 1]),
                      ints(tokens[0] + tokens[1]))
    gctx.run_timing()
    _, counts = gctx.decode_run(ints([0, 1]), ints([len(t) for t in tokens]), first,
                                ints([2, 6]), 6)
    assert list(counts) == [2, 6] and gctx.run_timing()["held_rows"] == 0


@pytest.mark.parametrize("token", [-1, -100, 10**6])
def test_a_token_id_outside_the_vocabulary_is_a_value_error(model, token):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.token_to_piece(token)


# ---- embeddings ----

@ON_GPU_NOT_BATCH_INVARIANT  # on an H100 a packed vector differed from alone by up to 0.02
def test_embedder_packs_inputs_and_each_vector_is_its_own(model):
    """More inputs than fit one decode are split over several; each input's unit vector is the
    one it gets alone, wherever it was packed."""
    embedder = _core.Embedder(model, n_ctx=64, n_seq_max=2, n_threads=1)
    texts = ["The sea is wide.", "def f(x): return x", "Paris, France", "1 2 3 4 5 6 7"]
    inputs = [model.tokenize(t) for t in texts]
    together = embedder.embed(inputs)
    assert len(together) == 4 and all(len(v) == embedder.n_embd for v in together)
    for tokens, vector in zip(inputs, together):
        (alone,) = embedder.embed([tokens])
        assert math.isclose(sum(x * x for x in alone), 1.0, rel_tol=1e-5)
        assert list(vector) == pytest.approx(list(alone), abs=1e-5)
    assert together[0] != together[1]


def test_embedder_calls_back_before_each_decode_and_stops_where_the_callback_raises(model):
    embedder = _core.Embedder(model, n_ctx=64, n_seq_max=2, n_threads=1)
    inputs = [model.tokenize(t) for t in ["One.", "Two.", "Three.", "Four.", "Five."]]
    calls = []
    assert len(embedder.embed(inputs, lambda: calls.append(len(calls)))) == 5
    assert calls == [0, 1, 2]  # two inputs a decode

    def stop_at_the_second():
        calls.append(None)
        if len(calls) == 2:
            raise InterruptedError

    calls.clear()
    with pytest.raises(InterruptedError):
        embedder.embed(inputs, stop_at_the_second)
    assert len(calls) == 2
    assert len(embedder.embed(inputs[:1])) == 1  # and it embeds again after


def test_embedder_abort_stops_the_decode_in_progress_from_another_thread(model):
    embedder = _core.Embedder(model, n_ctx=512, n_seq_max=1, n_threads=1)
    inputs = [[1] * 500] * 8  # a decode each
    decodes, failure = [], []

    def embed():
        try:
            embedder.embed(inputs, lambda: decodes.append(1))
        except Exception as e:  # noqa: BLE001 - the test reads it
            failure.append(e)

    worker = threading.Thread(target=embed)
    worker.start()
    while worker.is_alive():  # an abort before a decode has begun stops nothing: repeat it
        embedder.abort()
        time.sleep(0.005)
    assert len(failure) == 1 and isinstance(failure[0], _core.DecodeAborted), failure
    assert len(decodes) < len(inputs)
    assert len(embedder.embed(inputs[:1])) == 1  # and it embeds again after


@pytest.mark.parametrize("tokens, words", [([], "1 to 64"), (list(range(65)), "1 to 64"),
                                           ([10**6], "token ids")])
def test_embedder_rejects_inputs_that_cannot_fit(model, tokens, words):
    embedder = _core.Embedder(model, n_ctx=64, n_seq_max=2, n_threads=1)
    with pytest.raises(ValueError, match=words):
        embedder.embed([tokens])
