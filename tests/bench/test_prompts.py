"""The prompt generators: deterministic, the lengths asked for, shared where meant to be."""
import math
import random

import pytest

from cllm.bench import prompts


def test_standard_prompts(tmp_path):
    synthetic = prompts.synthetic(100, 5)
    assert len(set(synthetic)) == 5 and all(len(p.split()) == 99 for p in synthetic)
    file = tmp_path / "p.txt"
    file.write_text("one\n\n two \n")
    assert prompts.from_file(file) == ["one", "two"]
    assert prompts.for_requests(["a", "b", "c"], 4, offset=2) == ["c", "a", "b", "c"]


def _pieces(text: str) -> int:
    """Words, punctuation marks and paragraph breaks: about a token each."""
    return len(text.replace(",", " ,").replace(".", " .").replace("\n\n", " ¶ ").split())


def test_text_is_seeded_and_of_the_length_asked():
    a, b = prompts.text(random.Random(3), 500), prompts.text(random.Random(3), 500)
    assert a == b != prompts.text(random.Random(4), 500)
    assert _pieces(a) == 500 and "\n\n" in a and a[0].isupper()


def test_shared_prefix_shares_exactly_the_document():
    batch = prompts.shared_prefix(1400, 20, seed=0)
    assert batch == prompts.shared_prefix(1400, 20, seed=0)
    assert batch != prompts.shared_prefix(1400, 20, seed=1)
    document = batch[0].split("\n\nQuestion 1:")[0]
    assert _pieces(document) == 1400
    tails = [p[len(document):] for p in batch]
    assert all(p.startswith(document) for p in batch) and len(set(tails)) == len(batch)
    assert all(t.startswith(f"\n\nQuestion {i + 1}: ") for i, t in enumerate(tails))
    assert len({t.split(": ", 1)[1] for t in tails}) > 10  # the wording varies, not the number
    assert all(len(t.split()) < 20 for t in tails)  # short next to the document


def test_shared_prefix_over_several_documents_draws_each():
    batch = prompts.shared_prefix(200, 30, seed=0, documents=3)
    assert batch == prompts.shared_prefix(200, 30, seed=0, documents=3)
    documents = [p.split("\n\nQuestion ")[0] for p in batch]
    assert len(set(documents)) == 3 and all(_pieces(d) == 200 for d in set(documents))
    assert all(2 <= documents.count(d) <= 28 for d in set(documents))
    # One document draws the prompts it always did: earlier results stay comparable.
    single = prompts.shared_prefix(200, 30, seed=0)
    assert single == prompts.shared_prefix(200, 30, seed=0, documents=1)


def test_mixed_lengths_span_the_range():
    batch = prompts.mixed(200, 16, 4000, seed=0)
    assert batch == prompts.mixed(200, 16, 4000, seed=0) and len(set(batch)) == 200
    lengths = [_pieces(p) for p in batch]
    assert 16 <= min(lengths) < 32 and 2000 < max(lengths) <= 4000
    # log-uniform: about as many prompts below the geometric mean as above it
    middle = math.sqrt(16 * 4000)
    assert 70 < sum(n < middle for n in lengths) < 130


@pytest.mark.parametrize("make", [prompts.system_prompt, prompts.user_message])
def test_conversation_text_is_seeded_and_varied(make):
    assert make(random.Random(1)) == make(random.Random(1))
    assert len({make(random.Random(seed)) for seed in range(20)}) == 20
