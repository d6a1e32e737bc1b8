"""The prompts a benchmark sends: a fixed default list, a file, synthetic prompts of N tokens,
and English-like text for the other workloads (a document with questions, prompts of mixed
lengths, conversations). All synthetic text comes from a seeded RNG: every run, and every
server in a run, gets the same prompts."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

DEFAULT_PROMPTS: tuple[str, ...] = (
    "Explain why the sky is blue in simple terms.",
    "Write a short poem about a lighthouse in winter.",
    "What are three good habits for staying productive when working from home?",
    "Summarize the plot of a detective story set on a train.",
    "Give me a recipe for a quick vegetable soup.",
    "How does a bicycle stay upright while it is moving?",
    "Describe the water cycle to a ten-year-old.",
    "List some tips for learning a new language as an adult.",
    "Write a friendly email inviting a colleague to lunch.",
    "What is the difference between weather and climate?",
    "Tell a short story about a robot who learns to paint.",
    "Why do cats purr, and what does it mean?",
    "Explain how a refrigerator keeps food cold.",
    "Suggest a weekend itinerary for a first visit to a mountain town.",
    "What should someone consider before adopting a dog?",
    "Describe a busy market on a Saturday morning.",
    "How do plants turn sunlight into food?",
    "Write the opening paragraph of a science fiction novel.",
    "What are the benefits of reading before going to sleep?",
    "Explain what a database index is and why it helps.",
    "Give advice to a student preparing for a difficult exam.",
    "Describe the sound of rain on a tin roof.",
    "How did ancient sailors navigate without modern instruments?",
    "Write a thank-you note to a neighbour who helped you move.",
)

# Common short words that most tokenizers keep as one token each when preceded by a space.
_WORDS = ("the time people year way day man thing woman life child world school state family "
          "student group country problem hand part place case week company system program "
          "question work government number night point home water room mother area money story "
          "fact month lot right study book eye job word business issue side kind head house "
          "service friend father power hour game line end member law car city community name").split()


# The structured workload's schema: a support ticket triaged into fields, as an application
# would ask for it (enums, bounded integers, bounded strings, an array of objects).
TICKET_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "technical", "account", "shipping", "other"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 80},
        "sentiment": {"enum": ["negative", "neutral", "positive"]},
        "actions": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"step": {"type": "string", "maxLength": 40},
                           "owner": {"enum": ["support", "engineering", "customer"]}},
            "required": ["step", "owner"], "additionalProperties": False}},
        "needs_reply": {"type": "boolean"},
    },
    "required": ["category", "priority", "summary", "sentiment", "actions", "needs_reply"],
    "additionalProperties": False,
}


def ticket(prompt: str) -> str:
    """A structured-workload request: one of the default prompts as a customer's message."""
    return f"Triage this customer message as a support ticket, in JSON.\n\nMessage: {prompt}"


def from_file(path: Path) -> list[str]:
    """One prompt per non-empty line."""
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise SystemExit(f"{path} holds no prompt")
    return prompts


def synthetic(n_tokens: int, count: int, seed: int = 0) -> list[str]:
    """`count` different prompts of about `n_tokens` tokens each (the report shows the servers'
    own count). Different words per prompt, so no server gains from a shared prefix cache."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(max(1, n_tokens - 1)))
            for _ in range(count)]


def for_requests(prompts: list[str], n: int, offset: int = 0) -> list[str]:
    """n prompts, cycling through the list from `offset` (so warm-up and measured runs differ)."""
    return [prompts[(offset + i) % len(prompts)] for i in range(n)]


# English-like text: sentences from patterns over common words. Each word and each punctuation
# mark is about one token for a Llama-style tokenizer, which is how lengths are counted here.
_VOCAB = {
    "adj": ("small large early late quiet busy local public simple careful bright old new "
            "young cold warm heavy light strong narrow wide rural modern").split(),
    "noun": ("river village market teacher farmer bridge road engine garden library council "
             "winter harvest train letter family school museum station report machine storm "
             "festival harbour mountain doctor").split(),
    "verb": ("opened closed crossed repaired visited described changed followed built found "
             "moved watched carried reached measured").split(),
    "adv": "slowly quickly often rarely carefully quietly again later early together".split(),
    "prep": "near behind across under beside through after before along beyond".split(),
    "det": "the a every each one another".split(),
    "conj": "because while although when after since".split(),
}
_PATTERNS = (
    "det adj noun verb det noun .",
    "det noun verb det adj noun prep det noun .",
    "adv , det adj noun verb det noun prep det noun .",
    "det noun verb det noun conj det adj noun verb det noun .",
    "prep det adj noun , det noun adv verb det noun .",
)
_QUESTIONS = (
    "What does the text say about the {noun}?",
    "Who {verb} the {adj} {noun}, and why?",
    "Summarize in one sentence what happened {prep} the {noun}.",
    "Which {noun} is described as {adj}, and where is it?",
    "List every place where a {noun} is {verb}.",
    "Why would a reader care about the {adj} {noun}?",
    "How often does the {noun} appear, and in which paragraphs?",
    "Explain what the {noun} {verb} {prep} the {noun}.",
)


def text(rng: random.Random, n_tokens: int) -> str:
    """Paragraphs of English-like sentences, cut at about `n_tokens` tokens."""
    pieces: list[str] = []
    while len(pieces) < n_tokens:
        if pieces and rng.random() < 0.15:
            pieces.append("\n\n")  # a paragraph break now and then
        pieces += _sentence(rng)
    return _join(pieces[:n_tokens])


def _sentence(rng: random.Random) -> list[str]:
    words = [p if p in ",." else rng.choice(_VOCAB[p]) for p in rng.choice(_PATTERNS).split()]
    return [words[0].capitalize(), *words[1:]]


def _join(pieces: list[str]) -> str:
    out = ""
    for piece in pieces:
        glued = piece in ",." or piece == "\n\n" or not out or out.endswith("\n\n")
        out += piece if glued else " " + piece
    return out.strip()


def _ask(rng: random.Random) -> str:
    words = {slot: rng.choice(choices) for slot, choices in _VOCAB.items()}
    return rng.choice(_QUESTIONS).format(**words)


def question(rng: random.Random, number: int) -> str:
    """A short question about a document, numbered so that no two are the same."""
    return f"\n\nQuestion {number}: " + _ask(rng)


def system_prompt(rng: random.Random) -> str:
    """Notes to answer from, then the instruction. Each conversation has its own notes, so
    conversations share at most a word or two of prefix beyond the chat template's."""
    return text(rng, 60) + "\n\nAnswer the user's questions about these notes briefly."


def user_message(rng: random.Random) -> str:
    """A user's turn: a few sentences of context, then a question."""
    return text(rng, rng.randint(16, 48)) + " " + _ask(rng)


def shared_prefix(doc_tokens: int, count: int, seed: int, documents: int = 1) -> list[str]:
    """`count` prompts: one of `documents` documents of about `doc_tokens` tokens each, drawn
    at random, then each its own question."""
    rng = random.Random(seed)
    library = [text(rng, doc_tokens) for _ in range(documents)]
    draw = random.Random(f"{seed} documents")  # its own: one document draws the same as before
    return [library[draw.randrange(documents)] + question(rng, i + 1) for i in range(count)]


def mixed(count: int, lo: int, hi: int, seed: int) -> list[str]:
    """`count` different prompts whose lengths are log-uniform from `lo` to `hi` tokens: as
    many below the geometric mean of the bounds as above it, so mostly short, some long."""
    rng = random.Random(seed)
    lengths = [round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(count)]
    return [text(rng, n) for n in lengths]


# ShareGPT-like lengths in tokens: log-normal, heavy-tailed as chat traffic is (medians 100
# in and 130 out, means about 200 each), kept within vLLM's ShareGPT filters: at least 4 tokens
# each, a prompt of at most 1,024, prompt and reply together at most 2,048.
SHAREGPT_PROMPT = (math.log(100), 1.2)
SHAREGPT_OUTPUT = (math.log(130), 0.9)
SHAREGPT_LIMITS = (4, 1024, 2048)


def sharegpt_lengths(rng: random.Random) -> tuple[int, int]:
    """(prompt tokens, output tokens) of one request, drawn until they pass the filters."""
    least, most_prompt, most_total = SHAREGPT_LIMITS
    while True:
        n_in = round(rng.lognormvariate(*SHAREGPT_PROMPT))
        n_out = round(rng.lognormvariate(*SHAREGPT_OUTPUT))
        if least <= n_in <= most_prompt and n_out >= least and n_in + n_out <= most_total:
            return n_in, n_out


def sharegpt_synthetic(count: int, seed: int) -> list[tuple[str, int]]:
    """`count` (prompt, output length) pairs with ShareGPT-like lengths, all different."""
    rng = random.Random(seed)
    return [(text(rng, n_in), n_out) for n_in, n_out in
            (sharegpt_lengths(rng) for _ in range(count))]


def sharegpt_file(path: Path) -> list[tuple[str, int]]:
    """(first human turn, its reply's length) of each conversation of a ShareGPT-style JSON
    file ([{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]).
    The reply's length is estimated at 4 characters a token (no tokenizer here); pairs outside
    the filters above are left out."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot read the ShareGPT file {path}: {e}") from None
    least, most_prompt, most_total = SHAREGPT_LIMITS
    pairs = []
    for item in data if isinstance(data, list) else []:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = (str(t.get("value", "")) if isinstance(t, dict) else "" for t in turns[:2])
        n_in, n_out = len(prompt) // 4, len(reply) // 4
        if least <= n_in <= most_prompt and n_out >= least and n_in + n_out <= most_total:
            pairs.append((prompt, n_out))
    if not pairs:
        raise SystemExit(f"{path} holds no usable conversation")
    return pairs
