"""Offline prompt generators for the data mixture: templated grade-school math word problems
and general-chat instructions (instruction templates x topics).

Both are deterministic given a seed, need no network, and never reuse a filled prompt. They
widen the training distribution beyond code; the held-out dev set (`dflash_jax/assets/eval`) is
hand-written in other wordings, and `OverlapFilter` keeps any look-alike out of training.
"""

from __future__ import annotations

import itertools

import numpy as np

from dflash_jax.training.prompts import Prompt

NAMES = (
    "Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Kira",
    "Leo", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor",
    "Wen", "Yara", "Zoe", "Omar", "Lena", "Mateo", "Nina", "Arjun",
)  # fmt: skip
ITEMS = (
    "apples", "marbles", "stickers", "pencils", "cookies", "books", "cards", "stamps", "shells",
    "balloons", "oranges", "toy cars", "candies", "coins", "beads", "muffins",
)  # fmt: skip
PREFIXES = ("", "", "Solve this problem step by step. ", "Math question: ",
            "Please show your work. ", "Can you help me with this word problem? ")  # fmt: skip


def _math_problem(rng: np.random.Generator) -> str:
    """One word problem from one of 20 templates, with random names and quantities."""
    name, other = (str(x) for x in rng.choice(NAMES, 2, replace=False))
    item = str(rng.choice(ITEMS))
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    kind = r(0, 19)
    if kind == 0:
        a, b = r(10, 60), r(2, 30)
        c = r(1, a + b - 1)
        return (f"{name} has {a} {item}. {name} buys {b} more and then gives {c} to {other}. "
                f"How many {item} does {name} have now?")  # fmt: skip
    if kind == 1:
        p, n = r(2, 9), r(2, 8)
        bill = (p * n // 10 + 1) * 10
        return (f"A bakery sells muffins for ${p} each. {name} buys {n} muffins and pays with a "
                f"${bill} bill. How much change does {name} get?")  # fmt: skip
    if kind == 2:
        v, t = r(30, 120), r(2, 9)
        return f"A train travels at {v} kilometers per hour for {t} hours. How far does it go?"
    if kind == 3:
        p, total = r(8, 40), r(120, 600)
        return (f"{name} reads {p} pages every day. How many days does it take {name} to finish "
                f"a book with {total} pages?")  # fmt: skip
    if kind == 4:
        n, d = r(20, 40), int(rng.choice([2, 4, 5]))
        n -= n % d
        return (f"There are {n} students in a class and 1/{d} of them walk to school. The rest "
                f"take the bus. How many students take the bus?")  # fmt: skip
    if kind == 5:
        l, w = r(3, 25), r(2, 20)
        return (f"A rectangle is {l} cm long and {w} cm wide. What are its area and its "
                f"perimeter?")  # fmt: skip
    if kind == 6:
        s, w = r(5, 40), r(3, 20)
        return f"{name} saves ${s} every week. How much money has {name} saved after {w} weeks?"
    if kind == 7:
        a, n, m = r(2, 5), r(12, 24), r(30, 96)
        return (f"A recipe uses {a} cups of flour to make {n} cookies. How many cups of flour are "
                f"needed to make {m} cookies?")  # fmt: skip
    if kind == 8:
        a, b, c = r(5, 40), r(2, 15), r(2, 10)
        return (f"{name} is {a} years old. {other} is {b} years older than {name}. How old will "
                f"{other} be in {c} years?")  # fmt: skip
    if kind == 9:
        pct, price = int(rng.choice([10, 15, 20, 25, 30, 40, 50])), r(20, 200)
        return (f"A jacket costs ${price}. The store offers a {pct}% discount. What is the price "
                f"after the discount?")  # fmt: skip
    if kind == 10:
        a, b, c = r(2, 12), r(2, 12), r(2, 12)
        return (f"{name} ran {a} km on Monday, {b} km on Tuesday and {c} km on Wednesday. What "
                f"is the average distance {name} ran per day?")  # fmt: skip
    if kind == 11:
        a, b = r(3, 30), r(2, 20)
        return (f"A farmer has {a} chickens and {b} cows. How many legs do the animals have "
                f"altogether?")  # fmt: skip
    if kind == 12:
        n, total = r(3, 9), r(20, 100)
        return (f"{n} friends share {total} {item} equally. How many {item} does each friend "
                f"get, and how many are left over?")  # fmt: skip
    if kind == 13:
        cap, rate = r(50, 500), r(5, 25)
        return (f"A water tank holds {cap} liters. A pump fills it at {rate} liters per minute. "
                f"How long does it take to fill the empty tank?")  # fmt: skip
    if kind == 14:
        a, p1, b, p2 = r(2, 9), r(2, 6), r(2, 12), r(1, 3)
        return (f"{name} buys {a} notebooks at ${p1} each and {b} pens at ${p2} each. How much "
                f"does {name} spend in total?")  # fmt: skip
    if kind == 15:
        t1, d, e = r(5, 20), r(3, 12), r(2, 15)
        return (f"The temperature was {t1} degrees in the morning. It rose by {d} degrees by "
                f"noon and fell by {e} degrees by evening. How warm was it then?")  # fmt: skip
    if kind == 16:
        g, dist = r(5, 12), r(100, 900)
        return (f"A car uses {g} liters of fuel per 100 km. How much fuel does it need for a "
                f"trip of {dist} km?")  # fmt: skip
    if kind == 17:
        scores = [r(60, 100) for _ in range(4)]
        avg = r(75, 90)
        return (f"{name} scored {scores[0]}, {scores[1]}, {scores[2]} and {scores[3]} on four "
                f"tests. What score does {name} need on the fifth test to have an average of "
                f"{avg}?")  # fmt: skip
    if kind == 18:
        h, m, dur = r(1, 11), int(rng.choice([0, 15, 30, 45])), r(70, 180)
        return (
            f"A movie starts at {h}:{m:02d} pm and lasts {dur} minutes. At what time does it end?"
        )
    a, d = r(2, 8), r(3, 12)
    b = a * int(rng.choice([2, 3])) if r(0, 1) else max(1, a // 2)
    return (f"If {a} workers can paint a fence in {d} days, how many days would {b} workers "
            f"take, working at the same rate?")  # fmt: skip


def math_prompts(limit: int, seed: int = 0) -> list[Prompt]:
    """`limit` distinct templated grade-school word problems."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    out = []
    for _ in range(limit * 20):
        text = str(rng.choice(PREFIXES)) + _math_problem(rng)
        if text not in seen:
            seen.add(text)
            out.append(Prompt(text, "math:template"))
            if len(out) >= limit:
                break
    return out


TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "machine learning", "inflation",
    "the French Revolution", "vaccines", "climate change", "the internet", "blockchain",
    "plate tectonics", "the immune system", "renewable energy", "the stock market",
    "quantum computing", "the Roman Empire", "volcanoes", "sleep", "meditation", "recycling",
    "electric cars", "the human heart", "gravity", "the printing press", "coral reefs",
    "artificial intelligence", "supply and demand", "the moon landing", "honeybees",
    "nuclear power", "rainforests", "the Renaissance", "DNA", "earthquakes", "social media",
    "compound interest", "the solar system", "antibiotics", "democracy", "coffee",
    "the Silk Road", "jazz music", "chess", "deserts", "tides", "the Olympic Games",
    "smartphones", "public libraries", "bread baking", "rivers", "video games", "dinosaurs",
    "the Great Wall of China", "electricity", "photography", "mountains", "penguins",
    "open source software", "time zones", "origami",
)  # fmt: skip
ACTIVITIES = (
    "learning a new language", "staying focused while studying", "saving money", "running a "
    "first marathon", "cooking healthy meals", "sleeping better", "giving a presentation",
    "starting a vegetable garden", "keeping a tidy home", "preparing for a job interview",
    "traveling on a budget", "learning to play the guitar", "writing a novel", "making friends "
    "in a new city", "reducing stress", "learning to code", "training a puppy", "organizing a "
    "birthday party", "taking better photos", "working from home", "reading more books",
    "staying hydrated", "hiking safely", "moving to a new apartment", "managing time",
)  # fmt: skip
PEOPLE = (
    "my landlord", "a teacher", "my manager", "a customer", "a neighbor", "the city council",
    "a hotel", "a professor", "my team", "a client",
)  # fmt: skip
SUBJECTS = (
    "a broken heater", "a missed deadline", "a refund", "next week's meeting", "a schedule "
    "change", "a noise complaint", "a project update", "a reservation", "an invoice",
    "a vacation request",
)  # fmt: skip
PRODUCTS = (
    "a reusable water bottle", "noise-cancelling headphones", "a standing desk", "a solar "
    "lantern", "a smart thermostat", "hiking boots", "a coffee grinder", "a backpack",
    "a reading lamp", "a yoga mat",
)  # fmt: skip
CHAT_TEMPLATES = (
    ("Explain {t} to a beginner.", "topic"),
    ("What is {t}? Keep it short.", "topic"),
    ("Write a short poem about {t}.", "topic"),
    ("Give me three interesting facts about {t}.", "topic"),
    ("Summarize the history of {t} in a paragraph.", "topic"),
    ("Why is {t} important?", "topic"),
    ("Write a short story for children about {t}.", "topic"),
    ("What are common misconceptions about {t}?", "topic"),
    ("Explain {t} using a simple analogy.", "topic"),
    ("Give me five tips for {t}.", "activity"),
    ("How should I get started with {t}?", "activity"),
    ("What are the most common mistakes people make when {t}?", "activity"),
    ("Make a one-week plan for {t}.", "activity"),
    ("Write a polite email to {t[0]} about {t[1]}.", "email"),
    ("Write a product description for {t}.", "product"),
    ("What are the pros and cons of {t}?", "product"),
    ("Compare {t[0]} and {t[1]}.", "pair"),
)


def chat_prompts(limit: int, seed: int = 0) -> list[Prompt]:
    """`limit` distinct general-chat instructions: each template filled from its topic list."""
    fills = {
        "topic": TOPICS,
        "activity": ACTIVITIES,
        "email": tuple(itertools.product(PEOPLE, SUBJECTS)),
        "product": PRODUCTS,
        "pair": tuple(itertools.combinations(TOPICS[:24], 2)),
    }
    candidates = [
        template.format(t=fill) for template, kind in CHAT_TEMPLATES for fill in fills[kind]
    ]
    order = np.random.default_rng(seed).permutation(len(candidates))
    return [Prompt(candidates[i], "chat:template") for i in order[:limit]]
