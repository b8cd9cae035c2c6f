"""Diverse chat prompts built from code, for self-distilling a real target (`draftsmith self-distill`), and
plain-text openings for a base model without a chat template (`build_text_prompts`).

No hub, no downloaded data: code tasks come from the running interpreter's standard library (functions
to write from their docstrings, functions to explain, modules to describe), prose to summarise and rewrite
comes from the stdlib's module docstrings, and the rest (arithmetic, word problems, short factual
questions, lists and formats, multi-turn follow-ups) from small templates filled by a seeded RNG.
Every prompt is a conversation ending in a user turn; multi-turn ones hold an empty assistant turn that
regeneration fills first. The split is by a hash of the first user turn, so it never depends on order.
`build_more_prompts` adds training prompts to a set already answered, leaving its held-out split as it is.
`build_broad_prompts` makes everyday chat tasks of nine more kinds (advice, how-to, comparisons, ideas, reasons, pros
and cons, stories, letters, questions on a text) for a second training source (`draftsmith self-distill --broad`).
`build_other_prompts` makes prompts of kinds none of these is (recipes, travel plans, dialogues, product copy, SQL,
shell, reviews, translation): another domain, to measure a drafter's tau off its training traffic
(`draftsmith self-distill --target NAME --other-prompts` writes them to data/real/NAME/other_prompts.jsonl).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import itertools
import random

from draftsmith.data.reference import stdlib_files

HELDOUT_PERCENT = 8

COUNTRIES = {
    "France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Brazil": "Brasilia", "Canada": "Ottawa",
    "Egypt": "Cairo", "India": "New Delhi", "Mexico": "Mexico City", "Norway": "Oslo", "Peru": "Lima",
    "Spain": "Madrid", "Italy": "Rome", "Germany": "Berlin", "Chile": "Santiago", "Australia": "Canberra",
    "Vietnam": "Hanoi", "Poland": "Warsaw", "Ghana": "Accra", "Turkey": "Ankara", "Argentina": "Buenos Aires",
    "Sweden": "Stockholm", "Greece": "Athens", "Portugal": "Lisbon", "Thailand": "Bangkok", "Morocco": "Rabat",
}
CONCEPTS = [
    "photosynthesis", "gravity", "a prime number", "inflation", "an algorithm", "democracy", "evolution",
    "the water cycle", "an atom", "electricity", "a black hole", "climate", "a vaccine", "the internet",
    "a recursive function", "a hash table", "machine learning", "compound interest", "a volcano", "DNA",
    "an ecosystem", "the speed of light", "a binary search", "encryption", "a database index", "friction",
    "supply and demand", "a metaphor", "the immune system", "renewable energy", "a compiler", "an API",
    "version control", "a neural network", "the greenhouse effect", "an earthquake", "a fraction",
    "the Pythagorean theorem", "a sonnet", "cloud computing", "a memory leak", "a unit test", "recycling",
]
TOPICS = ["the ocean", "autumn", "a city at night", "friendship", "coffee", "the mountains", "a rainy day",
          "learning to code", "the moon", "a busy kitchen", "a quiet library", "spring flowers", "trains"]
CATEGORIES = ["fruits", "programming languages", "European capitals", "musical instruments", "mammals",
              "board games", "vegetables", "sports", "colors", "tools in a kitchen", "planets",
              "ways to save energy", "healthy breakfasts", "tips for studying", "Python built-in functions",
              "reasons to learn math", "things to pack for a trip", "jobs in a hospital", "types of clouds"]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jules", "Kemal", "Lena",
         "Mateo", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq"]
ITEMS = ["apples", "pencils", "stickers", "books", "marbles", "cookies", "coins", "cards", "shells", "stamps"]
FOLLOW_UPS = ["Can you make that shorter?", "Explain it to a ten-year-old.", "Can you give an example?",
              "Why is that?", "Now summarise your answer in one sentence.", "Can you say it more formally?",
              "What is a common mistake people make here?", "Put the main points in a bulleted list."]
CODE_FOLLOW_UPS = ["Add type hints to it.", "Write a short test for it.", "Can you explain how it works?",
                   "What is its time complexity?", "Add a docstring to it.", "Rewrite it without a loop, if you can."]


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@functools.cache
def stdlib_pools() -> tuple[tuple[str, ...], ...]:
    """(write-this-function, explain-this-function, what-is-this-module, prose paragraphs) from the stdlib, in file
    order (parsed once per process)."""
    write, explain, modules, prose = [], [], [], []
    for f in stdlib_files():
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        mod = f.relpath.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        doc = ast.get_docstring(tree)
        if doc and not mod.startswith("_") and "._" not in mod:
            modules.append(mod)
            prose += [p.strip() for p in doc.split("\n\n") if 200 <= len(p.strip()) <= 900
                      and p.count(">>>") == 0]
        lines = f.text.split("\n")  # ast numbers lines by "\n" alone; splitlines also breaks at form feeds
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            fdoc = ast.get_docstring(node)
            if fdoc and 20 <= len(first := fdoc.strip().split("\n\n")[0].replace("\n", " ")) <= 300:
                args = ", ".join(a.arg for a in node.args.args)
                write.append(f"Write a Python function `{node.name}({args})` that does the following: {first}")
            n = node.end_lineno - node.lineno + 1
            if 4 <= n <= 25:
                src = "\n".join(lines[node.lineno - 1: node.end_lineno])
                explain.append(f"Explain what this Python function does:\n\n```python\n{src}\n```")
    return tuple(write), tuple(explain), tuple(modules), tuple(prose)


def code_prompts(rng: random.Random) -> tuple[list[str], list[str], list[str], list[str]]:
    """stdlib_pools() as lists, each shuffled by `rng`."""
    pools = tuple(list(xs) for xs in stdlib_pools())
    for xs in pools:
        rng.shuffle(xs)
    return pools


def arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    return rng.choice([f"What is {a} + {b}?", f"What is {a} - {b}?", f"What is {a} times {b}?",
                       f"Compute {a * b} divided by {b}.", f"Is {a} a prime number? Explain briefly.",
                       f"What is {b}% of {a}?", f"Round {a / b:.4f} to two decimal places.",
                       f"What is the square of {b}?"])


def word_problem(rng: random.Random) -> str:
    p, q = rng.sample(NAMES, 2)
    item, a, b, c = rng.choice(ITEMS), rng.randint(5, 60), rng.randint(1, 4), rng.randint(2, 9)
    return rng.choice([
        f"{p} has {a} {item} and gives {b} to {q}. How many {item} does {p} have left?",
        f"{p} buys {c} bags with {a} {item} in each. How many {item} is that in total?",
        f"{p} and {q} share {a * c} {item} equally among {c} friends. How many does each friend get?",
        f"A train travels at {a} km per hour for {c} hours. How far does it go?",
        f"{p} reads {c} pages a day. How many days does a {a * c}-page book take?",
        f"A shirt costs ${a}. It is on sale for {10 * b}% off. What is the sale price?",
    ]) + rng.choice(["", " Show your steps.", " Answer with a short explanation."])


def factual(rng: random.Random) -> str:
    country = rng.choice(list(COUNTRIES))
    concept = rng.choice(CONCEPTS)
    return rng.choice([f"What is the capital of {country}?", f"What is {concept}?",
                       f"Explain {concept} in two sentences.", f"Name one fact about {country}.",
                       f"Which continent is {country} in?", f"What is {COUNTRIES[country]} known for?",
                       f"Give a simple definition of {concept}."])


def formats(rng: random.Random) -> str:
    cat, topic, n, name = rng.choice(CATEGORIES), rng.choice(TOPICS), rng.randint(3, 7), rng.choice(NAMES)
    return rng.choice([f"List {n} {cat}.", f"Give me {n} {cat} as a numbered list.",
                       f"Write a haiku about {topic}.", f"Write a short poem about {topic}.",
                       f"Write a JSON object describing a person named {name} with keys name, age and city.",
                       f"Make a markdown table of {n} {cat} with one column for a short description.",
                       f"Write a two-sentence story about {topic}.", f"Write a short email to {name} about {topic}.",
                       f"Give {n} {cat} separated by commas, nothing else.",
                       f"Write a tweet about {topic}.", f"Write a title for an article about {topic}."])


def rewrite(rng: random.Random, para: str) -> str:
    return rng.choice(["Summarise this in one sentence:\n\n", "Rewrite this text in simpler words:\n\n",
                       "Turn this into a bulleted list of key points:\n\n", "What is the main idea of this text?\n\n",
                       "Fix any grammar problems and make this clearer:\n\n"]) + para


def split_of(first_user: str) -> str:
    """"heldout" for HELDOUT_PERCENT of first user turns by their hash, else "train": a conversation's split never
    depends on the order or the set it was built in, and its follow-ups share it."""
    bucket = int(hashlib.sha256(first_user.encode()).hexdigest()[:8], 16) % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def build_prompts(n: int = 3300, seed: int = 0) -> list[dict]:
    """n distinct conversations `{"id", "kind", "split", "messages"}`, each ending in a user turn."""
    rng = random.Random(seed)
    write, explain, modules, prose = code_prompts(rng)
    makers = {  # kind -> (share of n, maker of one user text)
        "code_write": (0.18, lambda: write.pop()),
        "code_explain": (0.12, lambda: explain.pop()),
        "module": (0.05, lambda: f"What is the Python `{modules.pop()}` module used for?"),
        "rewrite": (0.10, lambda: rewrite(rng, rng.choice(prose))),
        "arithmetic": (0.12, lambda: arithmetic(rng)),
        "word_problem": (0.10, lambda: word_problem(rng)),
        "factual": (0.10, lambda: factual(rng)),
        "formats": (0.13, lambda: formats(rng)),
    }
    rows, seen = [], set()
    for kind, (share, make) in makers.items():
        target, tries = round(share * n), 0
        while sum(r["kind"] == kind for r in rows) < target and tries < 20 * target:
            tries += 1
            try:
                text = make()
            except IndexError:  # a stdlib pool ran dry
                break
            if text not in seen:
                seen.add(text)
                rows.append({"kind": kind, "messages": user(text)})
    # Multi-turn: a first question, an assistant turn regeneration fills, then a follow-up.
    firsts = [r for r in rows if r["kind"] != "rewrite"]
    while len(rows) < n:
        first = rng.choice(firsts)
        follow = rng.choice(CODE_FOLLOW_UPS if first["kind"].startswith("code") else FOLLOW_UPS)
        key = first["messages"][0]["content"] + "\n>> " + follow
        if key not in seen:
            seen.add(key)
            rows.append({"kind": "multi_turn", "messages": first["messages"] + [
                {"role": "assistant", "content": ""}, {"role": "user", "content": follow}]})
    for r in rows:
        users = [m["content"] for m in r["messages"] if m["role"] == "user"]
        r["id"] = hashlib.sha256("\n>> ".join(users).encode()).hexdigest()[:16]
        r["split"] = split_of(users[0])
    return [{"id": r["id"], "kind": r["kind"], "split": r["split"], "messages": r["messages"]} for r in rows]


def build_more_prompts(n: int, more: int, seed: int = 0) -> list[dict]:
    """Up to `more` training prompts that build_prompts(n, seed) lacks: those of build_prompts(n + more, seed) not in
    it and in the train split, a seeded draw of them in their kinds' mix. A new prompt whose first user turn hashes
    into the held-out split is left out, so build_prompts(n, seed)'s held-out prompts stay the held-out split."""
    have = {r["id"] for r in build_prompts(n, seed)}
    new = [r for r in build_prompts(n + more, seed) if r["id"] not in have and r["split"] == "train"]
    random.Random(seed).shuffle(new)
    return new[:more]


DISHES = ["tomato soup", "pancakes", "a vegetable curry", "fried rice", "banana bread", "guacamole", "lentil stew",
          "a mushroom risotto", "a Greek salad", "pasta carbonara", "chicken noodle soup", "apple crumble"]
INGREDIENTS = ["eggs", "rice", "spinach", "chickpeas", "potatoes", "cheese", "onions", "tomatoes", "oats", "lemons",
               "garlic", "carrots", "yogurt", "mushrooms"]
CITIES = ["Kyoto", "Barcelona", "Edinburgh", "Marrakesh", "Vancouver", "Istanbul", "Prague", "Cape Town", "Havana",
          "Reykjavik", "Seoul", "Florence"]
TRAVELLERS = ["a family with two small children", "a student on a tight budget", "a couple who love museums",
              "a solo hiker", "two retired friends who walk slowly", "a food lover", "a photographer"]
MONTHS = ["January", "April", "July", "October", "December"]
ROLES = [("a waiter", "a customer who got the wrong order"), ("a doctor", "a patient with a sore throat"),
         ("a landlord", "a tenant whose heater is broken"), ("a teacher", "a parent worried about homework"),
         ("a hotel receptionist", "a guest who lost their key"), ("a shop assistant", "a customer returning shoes"),
         ("a job interviewer", "a nervous candidate"), ("a taxi driver", "a tourist who is late for a flight")]
PRODUCTS = ["a stainless steel water bottle", "wireless earbuds", "a wooden desk lamp", "a hiking backpack",
            "a cast iron pan", "a yoga mat", "a smart thermostat", "a children's raincoat", "a mechanical keyboard",
            "a ceramic teapot"]
BUYERS = ["busy parents", "students", "gamers", "people who cook at home", "runners", "people who work from home"]
TABLES = {"orders": ("total", "status"), "employees": ("salary", "department"), "books": ("price", "author"),
          "students": ("score", "grade"), "products": ("stock", "category"), "flights": ("delay_minutes", "airline")}
SHELL_TASKS = ["counts the lines of every .txt file in a folder", "finds files larger than 100 MB under the home folder",
               "renames every .jpeg file in a folder to .jpg", "shows the 10 largest folders in the current one",
               "deletes files older than 30 days in /tmp/cache", "prints the 5 most common words in a text file",
               "replaces 'foo' with 'bar' in every .md file", "lists the 5 processes using the most memory",
               "packs a folder into a .tar.gz archive", "shows which process listens on port 8080",
               "counts the distinct IP addresses in a web server's access log"]
REVIEWS = {  # what was reviewed -> (praise, complaint)
    "hotel": ("has spotless rooms", "has a shower that never gets hot"),
    "pair of headphones": ("sounds great", "stopped charging after a week"),
    "restaurant": ("serves the best soup in town", "brought our food cold"),
    "phone case": ("fits perfectly", "cracked the first time I dropped it"),
    "film": ("has a clever ending", "is an hour too long"), "train journey": ("left right on time", "had no seats"),
    "coffee maker": ("is quick and quiet", "leaks onto the counter"),
    "novel": ("kept me up all night", "has a disappointing ending")}
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]
SENTENCES = ["My sister is going to the market tomorrow.", "Where is the nearest train station?",
             "We would like a table for four, please.", "I forgot my umbrella at the office.",
             "The museum opens at nine on Saturdays.", "Could you speak a little more slowly?",
             "Our neighbours have a very friendly dog.", "I am learning to play the guitar.",
             "How much does this jacket cost?", "It rained all weekend, so we stayed inside."]


def other_makers(rng: random.Random) -> dict:
    """kind -> maker of one user text, for tasks of kinds build_prompts never makes."""
    n, cost = rng.randint(2, 6), 100 * rng.randint(3, 20)
    table = rng.choice(list(TABLES))
    num, cat = TABLES[table]
    cols = f"`{table}(id, name, {cat}, {num}, created_at)`"
    thing, lang = rng.choice(list(REVIEWS)), rng.choice(LANGUAGES)
    good, bad = REVIEWS[thing]
    return {
        "recipe": lambda: rng.choice([
            f"Give me a recipe for {rng.choice(DISHES)} that serves {n}: the ingredients first, then numbered steps.",
            "I have {}, {} and {} at home. What could I cook for dinner, and how?".format(*rng.sample(INGREDIENTS, 3)),
            f"How do I make {rng.choice(DISHES)} without an oven?",
            f"How long should {rng.choice(DISHES)} cook, and how can I tell when it is done?"]),
        "travel_plan": lambda: rng.choice([
            f"Plan a {n}-day trip to {rng.choice(CITIES)} for {rng.choice(TRAVELLERS)}, day by day.",
            f"What should {rng.choice(TRAVELLERS)} know before visiting {rng.choice(CITIES)} in {rng.choice(MONTHS)}?",
            f"Suggest a one-day walking route through {rng.choice(CITIES)} for {rng.choice(TRAVELLERS)}.",
            f"I have {n} days and ${cost} to spend in {rng.choice(CITIES)}. How should I split the money?"]),
        "dialogue": lambda: rng.choice([
            "Write a short dialogue between {} and {}.", "Role-play: you are {} and I am {}. Start the conversation.",
            "Write a scene of " + str(2 * n + 2) + " lines in which {} talks with {}, each line starting with the "
            "speaker."]).format(*rng.choice(ROLES)),
        "product_description": lambda: rng.choice([
            f"Write a product description of about {20 * n} words for {rng.choice(PRODUCTS)} in an online shop.",
            f"Write three selling points for {rng.choice(PRODUCTS)}, aimed at {rng.choice(BUYERS)}.",
            f"Write a product title and a two-line description for {rng.choice(PRODUCTS)}.",
            f"A customer asks whether {rng.choice(PRODUCTS)} is worth ${cost // 10}. Answer as the shop."]),
        "sql": lambda: "Write an SQL query on a table {} that {}.".format(cols, rng.choice([
            f"returns the {n} rows with the highest `{num}`", f"counts the rows for each `{cat}`",
            f"gives the average `{num}` per `{cat}`, largest first",
            f"lists the names of rows created in {rng.choice(MONTHS)} 2024 whose `{num}` is above {cost}",
            f"deletes the rows whose `{cat}` is empty"])),
        "shell": lambda: rng.choice(["Give a bash one-liner that {}.", "How do I write a shell command that {}? "
                                     "Explain each part.", "Write a short shell script that {}, with a comment on "
                                     "each line."]).format(rng.choice(SHELL_TASKS)),
        "review": lambda: rng.choice([
            "Is this review positive, negative or mixed? Answer in one word, then explain.\n\n",
            "Write a polite reply from the business to this review:\n\n",
            "Which parts of this review could the business act on?\n\n"])
            + rng.choice([f"The {thing} {good}.", f"The {thing} {bad}.", f"The {thing} {good}, but it {bad}."]),
        "translation": lambda: rng.choice(["Translate into {}: \"{}\"", "How do you say \"{1}\" in {0}?",
                                           "Translate this sentence into {} and explain any tricky word: {}"])
            .format(lang, rng.choice(SENTENCES)),
    }


def kinds_taking_turns(makers, n: int, name: str) -> list[dict]:
    """n distinct one-turn conversations `{"id", "kind", "messages"}`, one of each kind of `makers()` in turn (the first
    k rows cover min(k, number of kinds) kinds); `makers()` is called once per round, for fresh fillers."""
    rows, seen = [], set()
    while len(rows) < n:
        for kind, make in list(makers().items())[: n - len(rows)]:
            text = next((t for t in (make() for _ in range(1000)) if t not in seen), None)
            if text is None:
                raise ValueError(f"{name}: the {kind} templates ran out of distinct prompts before n={n}; ask for fewer")
            seen.add(text)
            rows.append({"id": hashlib.sha256(text.encode()).hexdigest()[:16], "kind": kind, "messages": user(text)})
    return rows


def build_other_prompts(n: int = 64, seed: int = 0) -> list[dict]:
    """n distinct one-turn conversations `{"id", "kind", "messages"}` of kinds neither build_prompts nor
    build_broad_prompts makes, the 8 kinds taking turns (each kind has n // 8 or one more)."""
    rng = random.Random(seed)
    return kinds_taking_turns(lambda: other_makers(rng), n, "build_other_prompts")


TASKS = ["fix a flat bicycle tyre", "start a small vegetable garden", "write a good CV", "prepare for a job interview",
         "train a puppy to sit", "fall asleep faster", "save money every month", "keep a houseplant alive",
         "get better at public speaking", "organise a messy wardrobe", "start running as a beginner",
         "make a monthly budget", "stay focused while studying", "clean a laptop keyboard", "back up photos from a phone",
         "learn to touch type", "write a thank-you note", "choose a good password", "paint a room",
         "remove a coffee stain from a shirt", "keep a journal", "memorise a short speech", "set up a fish tank",
         "build a habit of reading every day", "change a flat car tyre", "start meditating", "make new friends in a new town"]
PAIRS = [("weather", "climate"), ("a virus", "a bacterium"), ("a list", "a tuple in Python"), ("a stock", "a bond"),
         ("RAM", "disk storage"), ("an alligator", "a crocodile"), ("speed", "velocity"), ("a lake", "a pond"),
         ("mass", "weight"), ("a simile", "a metaphor"), ("affect", "effect"), ("a comet", "an asteroid"),
         ("TCP", "UDP"), ("a debit card", "a credit card"), ("an ape", "a monkey"), ("a process", "a thread"),
         ("baking soda", "baking powder"), ("a hurricane", "a tornado"), ("a republic", "a monarchy"),
         ("a compiler", "an interpreter"), ("a poem", "a song"), ("renting", "buying a home"), ("a moth", "a butterfly"),
         ("a sprint", "a marathon"), ("an invoice", "a receipt"), ("a novel", "a short story"), ("HTTP", "HTTPS")]
OCCASIONS = ["a ten-year-old's birthday party", "a school science fair project", "a rainy weekend at home",
             "a team-building day at work", "a blog about {topic}", "a short film about {topic}", "a gift for a teacher",
             "a fundraiser for a local library", "a picnic with friends", "a club for people who like {topic}",
             "a first date", "a family reunion", "a podcast episode about {topic}", "a photo series about {topic}",
             "a board game night", "a retirement party", "a poster about recycling", "a summer reading challenge"]
SITUATIONS = ["my friend forgot my birthday", "a coworker keeps taking credit for my work",
              "I feel nervous before every exam", "my neighbour plays loud music late at night",
              "I cannot decide which university to choose", "my roommate never does the dishes",
              "I want to ask my manager for a raise", "I keep putting off my homework", "my little brother is bullied",
              "I spend too much time on my phone", "I lent money to a friend who has not paid it back",
              "I want to change careers at forty", "my parents disagree with my choice of job",
              "I have too many meetings to get real work done", "I moved to a new city and feel lonely"]
PHENOMENA = ["the sky is blue", "ice floats on water", "cats purr", "leaves change colour in autumn",
             "we get hiccups", "bread goes stale", "the sea is salty", "onions make us cry", "stars twinkle",
             "metal feels colder than wood", "we yawn", "bubbles are round", "planes leave white trails",
             "the moon has phases", "popcorn pops", "our voice sounds strange on recordings", "rainbows are curved",
             "soap removes grease", "we dream", "birds fly south in winter", "a spoon looks bent in a glass of water"]
CHOICES = ["working from home", "electric cars", "living in a big city", "learning the piano as an adult",
           "a four-day work week", "homeschooling", "owning a dog", "social media for teenagers", "nuclear power",
           "studying abroad", "buying a used car", "open-plan offices", "e-books over paper books", "school uniforms",
           "freelancing", "a gap year before university", "solar panels on a house", "public transport over driving"]
HEROES = ["a lighthouse keeper", "a shy robot", "an old fisherman", "a girl who can talk to birds", "a lost kitten",
          "a clockmaker", "a young astronaut", "a baker who cannot smell", "a forgetful wizard", "twin detectives",
          "a mail carrier in a small village", "a dragon afraid of fire"]
EVENTS = ["finds a map under the floor", "wakes up one morning able to fly", "has to keep a secret for a whole day",
          "meets a stranger who knows their name", "loses something important", "wins a contest by accident",
          "must cross a frozen river", "discovers a door that was not there yesterday"]
STYLES = ["", " Keep it short.", " Use a numbered list.", " Explain it as if I were a beginner.", " Be detailed.",
          " Give one concrete example.", " Answer in a friendly, casual tone.", " Start with a one-sentence summary."]
RECIPIENTS = [("the city council", "to fix the streetlights on my street"), ("my landlord", "for permission to get a cat"),
              ("a university", "for an extension on my application"), ("my bank", "to close an old account"),
              ("a school principal", "to start a chess club"), ("a local newspaper", "about the lack of bike lanes"),
              ("my employer", "for a week of unpaid leave"), ("an author", "to thank them for a book I loved"),
              ("a museum", "for a group discount for students"), ("my neighbours", "to invite them to a street party")]


def broad_makers(rng: random.Random, prose: tuple[str, ...]) -> dict:
    """kind -> maker of one user text, for everyday chat tasks that neither build_prompts nor build_other_prompts
    makes (advice, how-to, comparisons, ideas, reasons, stories, letters, extraction)."""
    n, topic = rng.randint(3, 8), rng.choice(TOPICS)
    a, b = rng.choice(PAIRS)
    return {
        "how_to": lambda: rng.choice(["How do I {}?", "What are the steps to {}?", "Give me a beginner's guide to how "
                                      "to {}.", "What mistakes should I avoid when I try to {}?"]).format(rng.choice(TASKS))
        + rng.choice(STYLES),
        "comparison": lambda: rng.choice([f"What is the difference between {a} and {b}?", f"Compare {a} and {b}.",
                                          f"Is {a} the same as {b}? Explain.",
                                          f"Make a table comparing {a} and {b} on {n} points."]) + rng.choice(STYLES),
        "brainstorm": lambda: rng.choice([f"Give me {n} ideas for ", f"Brainstorm {n} names for ",
                                          f"Suggest {n} creative themes for "]) + rng.choice(OCCASIONS).format(topic=topic)
        + ".",
        "advice": lambda: rng.choice(["{}. What should I do?", "Can you give me advice? {}.", "{}, and I do not know how "
                                      "to bring it up. Any tips?"]).format(rng.choice(SITUATIONS).capitalize())
        + rng.choice(STYLES),
        "why": lambda: rng.choice(["Why is it that {}?", "Can you explain why {}?", "Explain to a child why {}.",
                                   "What is the science behind the fact that {}?"]).format(rng.choice(PHENOMENA))
        + rng.choice(STYLES),
        "pros_cons": lambda: rng.choice(["What are the pros and cons of {}?", "Give {n} arguments for and {n} against {}.",
                                         "Should I consider {}? Weigh it up for me."]).format(rng.choice(CHOICES), n=n)
        + rng.choice(STYLES),
        "story": lambda: rng.choice(["Write a short story about {} who {}.", "Tell me a bedtime story about {} who {}.",
                                     "Write the opening paragraph of a novel about {} who {}."]).format(
            rng.choice(HEROES), rng.choice(EVENTS)),
        "letter": lambda: rng.choice(["Write a formal letter to {} asking {}.", "Draft a polite message to {} asking {}.",
                                      "Help me write to {} to ask {}."]).format(*rng.choice(RECIPIENTS))
        + rng.choice(["", " Keep it under 150 words.", " Make it firm but friendly.", " Include a clear deadline."])
        + f" Sign it from {rng.choice(NAMES)}.",
        "extraction": lambda: rng.choice(["List every technical term in this text:\n\n",
                                          "What questions does this text answer? List them.\n\n",
                                          "Write three quiz questions, with answers, about this text:\n\n",
                                          "Which words in this text would a beginner need explained?\n\n"])
        + rng.choice(prose),
    }


def build_broad_prompts(n: int = 2000, seed: int = 0) -> list[dict]:
    """n distinct one-turn conversations `{"id", "kind", "split", "messages"}` of everyday chat tasks
    (broad_makers), the kinds taking turns: more kinds to train on than build_prompts has, none of the other domain's
    (build_other_prompts), so that domain stays unseen. Split by `split_of` as `build_prompts` is."""
    rng = random.Random(seed)
    prose = stdlib_pools()[3]
    return [{"id": r["id"], "kind": r["kind"], "split": split_of(r["messages"][0]["content"]), "messages": r["messages"]}
            for r in kinds_taking_turns(lambda: broad_makers(rng, prose), n, "build_broad_prompts")]


def kinds_in_turn(rows: list[dict]) -> list[dict]:
    """`rows` reordered so that their kinds take turns (kinds in order of first appearance, each kind's rows in their
    order): the first k rows of a file sorted by kind, such as a held-out split, then sample every kind."""
    by_kind: dict = {}
    for r in rows:
        by_kind.setdefault(r.get("kind"), []).append(r)
    return [r for turn in itertools.zip_longest(*by_kind.values()) for r in turn if r is not None]


def _dedent(lines: list[str], indent: int) -> list[str]:
    """Lines of a definition at column `indent` moved to the left margin: `indent` characters off every line that
    starts with them as whitespace (a docstring line at the margin stays as it is), whitespace-only lines emptied."""
    return ["" if not line.strip() else line[indent:] if line[:indent].isspace() else line for line in lines]


def text_openings(rng: random.Random) -> tuple[list[str], list[str]]:
    """(stdlib function and method headers with their docstrings, openings of stdlib module- and class-docstring
    paragraphs)."""
    code, prose = [], []
    for f in stdlib_files():
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        lines = f.text.split("\n")  # ast numbers lines by "\n" alone; splitlines also breaks at form feeds
        classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
        for node in tree.body + [n for c in classes for n in c.body]:
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and len(node.body) > 1:
                # def ... + docstring, a method dedented to the left margin
                header = "\n".join(_dedent(lines[node.lineno - 1: node.body[0].end_lineno], node.col_offset)) + "\n"
                if 80 <= len(header) <= 1200:
                    code.append(header)
        for doc in [ast.get_docstring(tree)] + [ast.get_docstring(c) for c in classes]:
            for para in (doc or "").split("\n\n"):
                para = " ".join(para.split())
                if len(para) >= 200 and ">>>" not in para:
                    cut = para.rfind(". ", 0, 240)
                    prose.append(para[: cut + 1] if cut > 60 else para[: para.rfind(" ", 0, 160)])
    code, prose = list(dict.fromkeys(code)), list(dict.fromkeys(prose))  # distinct, in file order
    for xs in (code, prose):
        rng.shuffle(xs)
    return code, prose


def build_text_prompts(n: int = 1200, seed: int = 0) -> list[dict]:
    """Up to n distinct plain-text openings `{"id", "kind", "split", "prompt"}` for a base model to continue: 70%
    code (a stdlib function's header and docstring), the rest prose while it lasts and code after that; split by a
    hash of the text as `build_prompts` does."""
    code, prose = text_openings(random.Random(seed))
    n_prose = min(len(prose), n - round(0.7 * n))
    picked = code[: n - n_prose] + prose[:n_prose]
    rows = []
    for text in picked:
        digest = hashlib.sha256(text.encode()).hexdigest()
        rows.append({"id": digest[:16], "kind": "code" if text.startswith(("def ", "async def ")) else "prose",
                     "split": "heldout" if int(digest[16:24], 16) % 100 < HELDOUT_PERCENT else "train",
                     "prompt": text})
    return rows
