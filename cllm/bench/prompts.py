"""The prompts a benchmark sends: a fixed default list, a file, or synthetic prompts of N tokens."""
from __future__ import annotations

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
