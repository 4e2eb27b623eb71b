"""User requests for draft training data, in three mixes (``DataConfig.prompts``).

Every row of a generation batch gets a :class:`RowPlan`: a *meta-prompt* the target answers first (with
sampling), and a rule that turns the target's reply into the user request the target then answers (a
written request needs neither).

- ``"topics"`` (the first store's mix): the target writes a question about a topic of an MT-Bench-like
  category (writing, roleplay, reasoning, math, coding, extraction, STEM, humanities, advice; none of
  MT-Bench's questions), and that question is the request.
- ``"tasks"``: the kinds of requests the topic questions lack — long inputs and copying. The target
  writes a passage (a news report, an email, a biography... about invented people and places, so
  names abound); the request wraps it: summarise it, answer a question from it, answer from several
  such documents (RAG-style, up to ~500 prompt tokens), translate part of it, rewrite or extract from
  it. Arithmetic word problems are drawn from templates with random numbers (their meta-reply is
  unused), and a share of topic questions stays in the mix.
- ``"written"``: requests written out in full, not by the target: a JSON-lines file of
  ``{"category", "text"}`` (``DataConfig.requests_file``; default ``train/requests.jsonl`` of the specdec-assets
  distribution: chat and instructions of every category above, summaries, extraction, context QA and RAG over passages
  written with them, translation into and out of English, rewriting; ``requests-2.jsonl`` a second set),
  e.g. a service's own traffic. No meta-prompt: the request is the row's prompt. Each seed takes every
  request of the file once, in its own order (``written_order``); a batch takes the next ``batch_size``.

None of this is tuned to a benchmark: the categories follow what users ask (MT-Bench's categories plus
translation, summarisation, QA, math and long-context RAG); the evaluation prompts
(``specdec/tools/bench/data/varied_prompts.jsonl``, MT-Bench) are never read here.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ...speculation.assets import asset_path

# (category, instruction template for the meta-prompt, topics). Generic topics, not MT-Bench questions.
TASKS: list[tuple[str, str, list[str]]] = [
    ("writing", "Write a request a user might send to an AI assistant asking it to write {t}.", [
        "a short story about a lighthouse keeper", "a blog post about learning to cook", "a poem about autumn",
        "a cover letter for a nursing job", "a product description for a reusable water bottle",
        "a speech for a friend's wedding", "a persuasive essay on public libraries", "a haiku about the sea",
        "an email asking a landlord to fix the heating", "a travel blog post about a mountain village",
        "a review of a fictional restaurant", "a thank-you note to a teacher", "a limerick about a cat",
        "a newsletter introduction for a gardening club", "a dialogue between two robots"]),
    ("roleplay", "Write a request a user might send to an AI assistant asking it to pretend to be {t} "
                 "and answer a question.", [
        "a pirate captain", "a medieval knight", "a famous detective", "a friendly tour guide in Rome",
        "a personal fitness coach", "a wise old wizard", "a startup founder pitching an idea",
        "a nutritionist", "a museum curator", "a sports commentator", "a time traveller from the future",
        "a customer support agent"]),
    ("reasoning", "Write a logic or reasoning puzzle a user might ask an AI assistant to solve, about {t}.", [
        "people sitting around a table", "the ages of three siblings", "a race between runners",
        "coloured balls in a box", "days of the week", "a family tree", "weights on a balance",
        "trains leaving two stations", "truth-tellers and liars", "ordering books on a shelf",
        "a clock's hands", "sharing apples among friends"]),
    ("math", "Write a math question a user might ask an AI assistant about {t}.", [
        "solving a linear equation", "the area of a triangle", "percentages and discounts",
        "probability of rolling dice", "prime numbers", "compound interest", "the Pythagorean theorem",
        "fractions", "derivatives of polynomials", "the sum of an arithmetic series", "averages",
        "unit conversion", "the volume of a cylinder", "simple integrals"]),
    ("coding", "Write a programming question a user might ask an AI assistant about {t}.", [
        "reversing a string in Python", "sorting a list of dictionaries", "reading a CSV file",
        "binary search", "a Python class for a bank account", "JavaScript promises", "SQL joins",
        "recursion and the Fibonacci sequence", "removing duplicates from a list", "writing a unit test",
        "regular expressions", "a linked list in C", "HTML forms", "counting words in a text file",
        "finding the largest number in an array"]),
    ("extraction", "Write a request a user might send to an AI assistant asking it to extract or summarise "
                   "information from {t}.", [
        "a short news article", "a list of products with prices", "a meeting transcript",
        "a restaurant menu", "a job advertisement", "a paragraph about a historical event",
        "customer reviews of a phone", "a recipe", "a company's quarterly report", "an email thread"]),
    ("stem", "Write a science or technology question a user might ask an AI assistant about {t}.", [
        "photosynthesis", "black holes", "how vaccines work", "climate change", "the water cycle",
        "DNA replication", "electric circuits", "machine learning", "plate tectonics", "the immune system",
        "renewable energy", "the speed of light", "chemical bonds", "how the internet works",
        "antibiotics"]),
    ("humanities", "Write a question a user might ask an AI assistant about {t}.", [
        "the French Revolution", "supply and demand", "the philosophy of Socrates", "the Renaissance",
        "the causes of World War I", "inflation", "democracy in ancient Athens", "Shakespeare's plays",
        "the Silk Road", "impressionist painting", "the Industrial Revolution", "ethics of artificial intelligence",
        "the Roman Empire", "learning a second language", "the history of jazz"]),
    ("advice", "Write a question a user might ask an AI assistant for advice about {t}.", [
        "saving money", "staying productive at home", "preparing for a job interview", "sleeping better",
        "starting to run", "making friends in a new city", "planning a trip to Japan", "caring for a puppy",
        "reducing stress", "studying for exams", "choosing a laptop", "healthy breakfast ideas"]),
]

# ----------------------------------------------------------------------------- passages (the "tasks" mix)
GENRES = ["a short news report", "a short encyclopedia entry", "a short email", "a short product review",
          "a short story", "the minutes of a short meeting", "a short biography", "a short company announcement",
          "a short travel guide entry", "a short letter to a newspaper", "a short scientific summary",
          "a short police report", "a short press release", "a short history of"]
SUBJECTS = ["the opening of a new bridge", "a flood after three days of rain", "a local football final",
            "a bakery that won a national prize", "a new electric bus line", "the discovery of an old shipwreck",
            "a school science fair", "a power cut in the city centre", "a startup that recycles batteries",
            "the restoration of a castle", "a music festival in the park", "a rare bird seen near the lake",
            "a hospital's new children's ward", "a strike at a car factory", "a library that lends tools",
            "a mountain rescue", "a farmers' market", "a chess tournament", "a museum exhibition of old maps",
            "a company moving its headquarters", "a new vaccine trial", "a drought and water restrictions",
            "a cycling race", "the anniversary of a theatre", "a city's plan to plant ten thousand trees",
            "a data breach at an online shop", "a volcano becoming active", "a wedding in a small village",
            "a ferry delayed by a storm", "a robot built by students"]
TOWNS = ["Millford", "Ashbury", "Port Elling", "Kessington", "Lower Brandon", "Vellmar", "Oakridge", "Saint Corin",
         "Harwick", "Dunmore", "Brixley", "Tallin Falls", "Grenhaven", "Marlow Bay", "Eastcombe", "Rivington"]
NAMES = ["Maria Novak", "James Okafor", "Priya Raman", "Lukas Berger", "Sofia Marquez", "Chen Wei", "Aisha Bello",
         "Tomasz Kowalski", "Emma Lindqvist", "Hiroshi Tanaka", "Fatima Haddad", "Oliver Grant", "Ines Duarte",
         "Rafael Costa", "Hannah Schmidt", "Daniel Mensah", "Yuki Sato", "Elena Petrova", "Samuel Adeyemi",
         "Claire Dubois", "Mateo Rossi", "Nadia Karim", "George Whitfield", "Leila Farah"]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]

SUMMARIZE = ["Summarize the following text in {n} sentences.\n\n{doc}",
             "Write a one-paragraph summary of this:\n\n{doc}",
             "{doc}\n\nTL;DR:", "Give me the key points of the text below as a bulleted list.\n\n{doc}",
             "Summarize this for a busy manager in {n} sentences:\n\n{doc}",
             "What is this text about? Be brief.\n\n{doc}"]
QUESTIONS = ["Who is mentioned in the text, and what did they do?", "Where and when did this happen?",
             "What is the main point of the text?", "What happened first, and what happened next?",
             "List three facts stated in the text.", "What numbers are mentioned, and what do they refer to?",
             "Why did this happen, according to the text?", "What will happen next, according to the text?"]
CONTEXT_QA = ["Answer the question using only the context below.\n\nContext:\n{doc}\n\nQuestion: {q}",
              "{doc}\n\nBased on the text above, {q_lower}",
              "Read the passage and answer the question.\n\nPassage: {doc}\n\n{q}"]
RAG = ["Use the documents below to answer the question. Say which document you used.\n\n{docs}\n\nQuestion: {q}",
       "You are given search results.\n\n{docs}\n\nUsing only these results, answer: {q}",
       "{docs}\n\nAnswer the following question from the documents above: {q}"]
TRANSLATE = ["Translate the following text into {lang}:\n\n{doc}", "Translate into {lang}: \"{doc}\"",
             "How would you say this in {lang}? \"{doc}\"", "Please translate this into {lang}, keeping the names "
             "unchanged:\n\n{doc}"]
REWRITE = ["Rewrite the following text so that a ten-year-old can understand it.\n\n{doc}",
           "Make this text more formal:\n\n{doc}",
           "Correct any grammar mistakes in the text below and return it.\n\n{doc}",
           "Extract every person, place and date from the text below as a JSON object.\n\n{doc}",
           "Turn the following text into a list of questions and answers.\n\n{doc}",
           "Write a headline and a one-sentence subtitle for this text.\n\n{doc}"]
KIND_WEIGHTS = {"question": 0.24, "summarize": 0.16, "context_qa": 0.14, "rag": 0.12, "translate": 0.12,
                "rewrite": 0.08, "math": 0.14}


@dataclass
class RowPlan:
    """One row's request recipe: ``category`` (a topic category or a task kind), the ``meta`` prompt the
    target answers first (empty for a written request: kind "written", its text in ``template``), and
    for task rows the ``kind`` and its drawn settings."""

    category: str
    meta: str
    kind: str = "question"
    template: str = ""
    fill: dict | None = None


def all_topics() -> list[tuple[str, str]]:
    """(category, meta-prompt) for every topic."""
    return [(cat, tmpl.format(t=t) + " Reply with the request only.") for cat, tmpl, ts in TASKS for t in ts]


def passage_meta(rng: random.Random) -> str:
    genre, subject = rng.choice(GENRES), rng.choice(SUBJECTS)
    names = " and ".join(rng.sample(NAMES, rng.choice([1, 2])))
    return (f"Write {genre} about {subject} in {rng.choice(TOWNS)}. Mention {names}, a date and some numbers. "
            "Write only the text.")


def written_file() -> Path:
    """The default written requests file: ``train/requests.jsonl`` of the specdec-assets distribution."""
    return asset_path("train", "requests.jsonl")


MIXES = ("topics", "tasks", "written")


def written_requests(path: str | Path | None = None) -> tuple[tuple[str, str], ...]:
    """(category, request) of every line of a written requests file (default ``written_file()``; JSON lines
    with "category" and "text"); ValueError naming the first malformed line."""
    path = Path(path or written_file()).resolve()
    if not path.is_file():
        raise ValueError(f"requests file {path} does not exist")
    stat = path.stat()
    return _read_requests(path, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=16)
def _read_requests(path: Path, mtime_ns: int, size: int) -> tuple[tuple[str, str], ...]:
    """The parsed file, cached per version (modification time and size)."""
    found = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            category, text = row["category"], row["text"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{i}: expected a JSON object with 'category' and 'text'") from None
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}:{i}: empty request")
        found.append((str(category), text))
    return tuple(found)


def written_digest(path: str | Path | None = None) -> str:
    """A short hash of a written requests file (default ``written_file()``; a shard of the "written" mix records
    it: the file and the seed decide which request each row answered)."""
    return hashlib.blake2b(Path(path or written_file()).read_bytes(), digest_size=8).hexdigest()


def written_order(seed: int, path: str | Path | None = None) -> list[int]:
    """The order in which seed ``seed`` takes the requests of ``path``: a permutation of their indices."""
    n = len(written_requests(path))
    return random.Random(f"written-{seed}").sample(range(n), n)


def plan_rows(mix: str, rng: random.Random, n: int, first: int = 0, seed: int = 0,
              requests: str | Path | None = None) -> list[RowPlan]:
    """``n`` row plans of the ``mix`` (one of ``MIXES``): "topics" and "tasks" drawn from ``rng``;
    "written": requests ``first .. first + n - 1`` of ``written_order(seed, requests)`` (fewer past the end)."""
    topics = all_topics()
    if mix == "topics":
        return [RowPlan(*topics[rng.randrange(len(topics))]) for _ in range(n)]
    if mix == "written":
        found = written_requests(requests)
        return [RowPlan(found[j][0], "", "written", found[j][1])
                for j in written_order(seed, requests)[first:first + n]]
    if mix != "tasks":
        raise ValueError(f"prompts={mix!r}: use one of {', '.join(map(repr, MIXES))}")
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    plans = []
    for _ in range(n):
        kind = rng.choices(kinds, weights)[0]
        if kind == "question":
            plans.append(RowPlan(*topics[rng.randrange(len(topics))]))
            continue
        template = rng.choice({"summarize": SUMMARIZE, "context_qa": CONTEXT_QA, "rag": RAG, "translate": TRANSLATE,
                               "rewrite": REWRITE, "math": ["{problem}"]}[kind])
        q = rng.choice(QUESTIONS)
        fill = {"n": rng.choice([1, 2, 3]), "lang": rng.choice(LANGUAGES), "q": q, "q_lower": q[0].lower() + q[1:],
                "problem": math_problem(rng), "others": rng.choice([1, 2]), "sentences": rng.choice([1, 2, 3])}
        plans.append(RowPlan(kind, passage_meta(rng), kind, template, fill))
    return plans


def clean_question(text: str) -> str:
    """The request inside the model's reply: a quoted part if there is one, else the reply without
    a leading "A user might ask:"-style line."""
    quoted = [q for q in re.findall(r'"([^"]{15,})"', text)]
    if quoted:
        return quoted[0].strip()
    text = text.strip()
    first, _, rest = text.partition("\n")
    if first.rstrip().endswith(":") and rest.strip():
        text = rest.strip()
    text = re.sub(r"^(a user might ask|request|question|user)\s*:\s*", "", text, flags=re.I)
    return text.strip().strip('"').strip()


def first_sentences(text: str, n: int) -> str:
    parts = re.split(r"(?<=[.!?])\s+", text.strip())
    return " ".join(parts[:n])


def build_requests(plans: list[RowPlan], replies: list[str]) -> list[str]:
    """The user request of every row from its plan and the target's meta-replies (all rows' replies: a
    RAG row reads the passages of the next passage rows as its other documents; a written request is
    its own text)."""
    out = []
    for i, (plan, reply) in enumerate(zip(plans, replies)):
        if plan.kind == "written":
            out.append(plan.template)
            continue
        if plan.kind == "question":
            text = clean_question(reply)
            out.append(text if len(text) >= 8 else plan.meta.split(" about ")[-1].rstrip("."))
            continue
        doc = reply.strip() or plan.meta
        f = dict(plan.fill, doc=doc)
        if plan.kind == "translate":
            f["doc"] = first_sentences(doc, f["sentences"])
        if plan.kind == "rag":   # the other documents: the next rows' passages
            passages = sorted((j for j, p in enumerate(plans) if p.kind not in ("question", "math") and j != i),
                              key=lambda j: (j - i) % len(plans))
            others = [replies[j].strip() for j in passages[: f["others"]]]
            docs = [doc, *others]
            order = list(range(len(docs)))
            order = order[len(docs) // 2:] + order[:len(docs) // 2]   # the answer's document not always first
            f["docs"] = "\n\n".join(f"Document {k + 1}:\n{docs[o]}" for k, o in enumerate(order))
        out.append(plan.template.format(**f))
    return out


def math_problem(rng: random.Random) -> str:
    """An arithmetic word problem with random numbers (with or without "step by step")."""
    name, item = rng.choice(NAMES).split()[0], rng.choice(["notebooks", "apples", "tickets", "bottles of water",
                                                            "pencils", "loaves of bread", "plants"])
    a, b, c = rng.randint(2, 19), rng.randint(2, 29), rng.randint(3, 60)
    x = rng.randint(-9, 15)
    price = rng.randint(2, 40) / 4
    kinds = [
        f"A shop sells {item} for ${price:.2f} each. {name} buys {a} of them and pays with a "
        f"${a * price // 10 * 10 + 10:.0f} note. How much change does {name} get?",
        f"Solve for x: {a}x + {b} = {a * x + b}.",
        f"What is {rng.choice([5, 12, 15, 20, 25, 35, 40, 75])}% of {c * 8}?",
        f"A train travels {a * c} km in {a} hours. What is its average speed in km/h?",
        f"Compute {a * 7 + b} × {c + 11}.",
        f"A rectangle is {a} cm wide and {b} cm long. What are its area and its perimeter?",
        f"{name} has {c} {item}, gives {min(a, c)} to a friend and then buys {b} more. "
        f"How many {item} does {name} have now?",
        f"Find the mean of these numbers: {', '.join(str(rng.randint(1, 99)) for _ in range(rng.randint(4, 7)))}.",
        f"Simplify the fraction {a * 6}/{b * 6}.",
        f"A recipe needs {a} cups of flour for {b} people. How much flour is needed for {c} people?",
        f"{name} saves ${b * 5} every month. How many months does it take to save ${b * 5 * c}?",
        f"The price of a jacket is ${c * 3}. It is reduced by {rng.choice([10, 20, 25, 30, 50])}%. "
        "What is the new price?",
        f"If {a} workers build a wall in {b} days, how long would {a + rng.randint(1, 6)} workers take "
        "at the same rate?",
        f"A bag holds {a} red and {b} blue marbles. What is the probability of drawing a red marble?",
    ]
    return rng.choice(kinds) + rng.choice(["", " Explain step by step.", " Show your work.", " Answer briefly."])
