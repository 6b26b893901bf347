"""A built-in, varied training prompt set for drafter distillation: chat, instructions, code and
arithmetic word problems, templated from word lists with a fixed seed. Evaluation prompts live
elsewhere (benchmarks/) and are never drawn from these templates."""

from __future__ import annotations

import random
import re

_TOPICS = [
    "the water cycle", "photosynthesis", "black holes", "the French revolution", "volcanoes",
    "machine learning", "the immune system", "plate tectonics", "the printing press",
    "renewable energy", "the Roman empire", "climate change", "honey bees", "the internet",
    "electric cars", "the human heart", "coral reefs", "the moon landing", "vaccines",
    "earthquakes", "the stock market", "rainbows", "the Great Wall of China", "dinosaurs",
    "solar panels", "the piano", "chess", "coffee", "recycling", "the Olympic games",
    "gravity", "tea ceremonies", "submarines", "deserts", "bicycles", "the violin",
    "the solar system", "antibiotics", "the Renaissance", "glaciers", "social media",
    "artificial intelligence", "the Amazon rainforest", "blockchain", "sleep", "nutrition",
    "time management", "public speaking", "the ocean tides", "bread baking", "gardening",
    "the Industrial Revolution", "electricity", "magnets", "the Pyramids of Giza", "owls",
    "friendship", "learning a new language", "budgeting", "exercise", "meditation",
    "airplanes", "the periodic table", "DNA", "hurricanes", "the Silk Road", "jazz music",
]
_CHAT = [
    "Explain {t} in simple terms.", "What are three interesting facts about {t}?",
    "Write a short paragraph about {t}.", "Why is {t} important?",
    "Give me a brief history of {t}.", "How would you explain {t} to a child?",
    "What are the pros and cons of {t}?", "Summarize what you know about {t} in two sentences.",
    "Write a haiku about {t}.", "List five questions a student might ask about {t}.",
    "What is {t}?", "Tell me about {t}.", "Can you describe {t}?", "How does {t} work?",
    "What should a beginner know about {t}?", "Write a short story involving {t}.",
    "Compare {t} and {u}.", "What is the connection between {t} and {u}?",
    "Give me three tips related to {t}.", "Write a tweet about {t}.",
    "What are common misconceptions about {t}?", "Describe {t} in one paragraph.",
]
_INSTRUCT = [
    "Rewrite this sentence more formally: '{s}'", "Translate to French: '{s}'",
    "Correct the grammar: '{s}'", "Make this sentence shorter: '{s}'",
    "Turn this into a question: '{s}'",
]
_SENTENCES = [
    "i think we should go to the park tomorrow", "the meeting was moved to friday afternoon",
    "my cat likes to sleep on the keyboard", "we didnt finish the project on time",
    "can you send me the report by tonight", "the weather is really nice today",
    "she has been learning to play guitar", "they are building a new library downtown",
]
_CODE = [
    "Write a Python function that {c}.", "Write a JavaScript function that {c}.",
    "Explain how to write code that {c}.", "Write a Python one-liner that {c}.",
]
_CODE_TASKS = [
    "reverses a string", "checks if a number is prime", "returns the factorial of n",
    "finds the longest word in a sentence", "flattens a nested list", "counts word frequencies",
    "validates an email address", "computes the average of a list", "reads a file line by line",
    "returns the second largest number in a list", "capitalizes every word in a string",
    "checks if two strings are anagrams", "converts a list of strings to integers",
    "counts the vowels in a string", "merges two sorted lists", "finds the maximum of a list",
    "removes duplicates from a list", "computes the Fibonacci sequence",
    "checks whether a word is a palindrome", "sums the digits of an integer",
    "converts Celsius to Fahrenheit", "sorts a list of tuples by the second element",
]
_NAMES = ["Tom", "Ana", "Liam", "Mia", "Noah", "Sara", "Omar", "Yuki", "Ravi", "Elena"]
_ITEMS = ["apples", "books", "marbles", "stickers", "cookies", "pencils", "coins", "cards"]


def _math(rng: random.Random) -> str:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 30), rng.randint(2, 9)
    templates = [
        f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
        f"{name} had {a + b} {item} and gave away {b}. How many are left?",
        f"There are {c} boxes with {b} {item} each. How many {item} are there in total?",
        f"{name} shares {b * c} {item} equally among {c} friends. How many does each get?",
        f"What is {a} times {c} plus {b}?",
        f"If a train travels {a} km per hour for {c} hours, how far does it go?",
        f"A shop sells {item} for ${c} each. How much do {b} {item} cost?",
        f"{name} reads {b} pages a day. How many pages in {c} weeks?",
        f"What is {a + b} minus {b}?", f"Is {a} an even or an odd number? Explain.",
        f"{name} is {a} years old. How old will {name} be in {b} years?",
    ]
    return rng.choice(templates)


_WORD_PROMPTS = [
    "What does the word '{w}' mean?", "Write a sentence using the word '{w}'.",
    "Tell me a short story about {w} and {v}.", "Write a poem about {w}.",
    "Explain the difference between {w} and {v}.", "Give me a fun fact related to {w}.",
    "Describe a day in the life of someone who loves {w}.", "Write an email about {w}.",
    "What are some synonyms for '{w}'?", "Write a product description for a {w}.",
    "How would you teach someone about {w}?", "Write a dialogue between two friends about {w}.",
]


def vocabulary_words(tokenizer, limit: int = 20000) -> list[str]:
    """Whole English words from a BPE vocabulary (tokens that start a word), as topic seeds."""
    words = []
    for token in tokenizer.hf.get_vocab():
        word = token[1:] if token.startswith("\u0120") else None
        if word and word.isalpha() and word.islower() and 5 <= len(word) <= 12:
            words.append(word)
    return sorted(words)[:limit]


_SELF_INSTRUCT = [
    "Write one question that a curious person might ask an assistant about {w}.",
    "Write one short programming task that involves {w}.",
    "Write one short math word problem about {w}.",
    "Write one request that a user might send to a helpful assistant about {w}.",
    "Write one question a student might ask about {w}.",
    "Write one instruction asking for a short text about {w}.",
]
_SELF_INSTRUCT_SUFFIX = " Reply with it only, in one line."


def self_instruct_requests(n: int, seed: int, words: list[str]) -> list[str]:
    """Requests asking the target to write a prompt itself (about a vocabulary word), so the
    training prompts are not limited to the variety of hand-written templates."""
    rng = random.Random(seed)
    return [rng.choice(_SELF_INSTRUCT).format(w=rng.choice(words)) + _SELF_INSTRUCT_SUFFIX
            for _ in range(n)]


_LIST_MARKER = re.compile(r"^(\d+[.)]|[-*\u2022]|(question|task|problem|request):)\s*", re.I)


def first_line_prompt(text: str, min_chars: int = 12) -> str | None:
    """The prompt in a target's reply to a self-instruct request: its first non-empty line,
    without list markers or quotes; None when that line is too short to be a prompt."""
    for line in text.splitlines():
        line = _LIST_MARKER.sub("", line.strip()).strip().strip('"\'').strip()
        if line:
            return line if len(line) >= min_chars else None
    return None


def training_prompts(n: int, seed: int = 0, words: list[str] | None = None) -> list[str]:
    """`n` prompts mixed across chat, instruction, code and math; with `words` (topic seeds,
    e.g. `vocabulary_words`), a third of them are open-ended prompts about those words."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 6
        if kind >= 4 and words:
            out.append(rng.choice(_WORD_PROMPTS).format(w=rng.choice(words),
                                                        v=rng.choice(words)))
        elif kind in (0, 4, 5):
            out.append(rng.choice(_CHAT).format(t=rng.choice(_TOPICS), u=rng.choice(_TOPICS)))
        elif kind == 1:
            out.append(rng.choice(_INSTRUCT).format(s=rng.choice(_SENTENCES)))
        elif kind == 2:
            out.append(rng.choice(_CODE).format(c=rng.choice(_CODE_TASKS)))
        else:
            out.append(_math(rng))
    return out
