"""Regenerate the built-in prompt set: `python scripts/make_prompts.py` writes eval/data/prompts.jsonl.

Prompts come from templates over five domains (code, math, json, prose, chat), seeded, so the
file is reproducible. Each prompt records its family (the template it was written from); the
held-out split is whole families (HELD_OUT_FAMILIES), so no template is on both sides. These are
template siblings all the same: the independent set (eval/data/independent.jsonl, written by hand)
is what the default eval measures.
"""

import json
import random
from pathlib import Path

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "merges two sorted lists", "counts the vowels in a string", "flattens a nested list",
    "computes the factorial of n", "removes duplicates from a list while keeping order",
    "checks whether a string is a palindrome", "returns the largest element of a list",
    "converts Celsius to Fahrenheit", "sums the digits of an integer", "finds the median of a list",
    "implements binary search", "counts word frequencies in a text", "transposes a matrix",
    "computes the greatest common divisor of two numbers", "checks whether brackets are balanced",
    "returns all permutations of a list", "parses a date string in YYYY-MM-DD format",
    "reads a CSV file and returns its rows", "capitalizes every word in a sentence",
    "computes a running average", "groups a list of words by their first letter",
    "rotates a list by k positions", "validates an email address with a regular expression",
]
LANGS = ["Python", "Python", "Python", "JavaScript", "C", "Rust", "Go"]
CODE_FORMS = [
    "Write a {lang} function that {task}.",
    "Implement a {lang} function that {task}, with a short docstring.",
    "Show me {lang} code that {task}, and explain it in one sentence.",
]
MATH_FORMS = [
    "What is {a} + {b}? Explain step by step.",
    "Compute {a} times {b} and show your work.",
    "A shop sells pencils at {a} cents each. How much do {b} pencils cost in dollars?",
    "Solve for x: {a}x + {b} = {c}.",
    "What is {a}% of {b}?",
    "A train travels {a} km in {b} hours. What is its average speed?",
]
ENTITIES = [
    ("a book", "title, author, year, genres"), ("a user account", "id, name, email, is_active"),
    ("a city", "name, country, population, landmarks"), ("a product", "sku, name, price, tags"),
    ("a weather report", "city, temperature, humidity, conditions"), ("a movie", "title, director, year, cast"),
    ("a recipe", "name, servings, ingredients, steps"), ("an employee", "name, role, salary, skills"),
    ("a flight", "number, origin, destination, departure_time"), ("a song", "title, artist, duration_seconds, album"),
]
JSON_FORMS = [
    "Return only a JSON object describing {entity} with the fields {fields}.",
    "Give a JSON array with two examples of {entity}, each with the fields {fields}.",
    "Write a JSON schema for {entity} with the properties {fields}.",
]
TOPICS = [
    "the ocean", "autumn in the mountains", "the history of the printing press", "how bees make honey",
    "a rainy day in a big city", "the importance of sleep", "the invention of the telephone",
    "life on a small farm", "the night sky", "learning a new language", "the water cycle",
    "a visit to a museum", "why forests matter", "the first day of school", "a lighthouse keeper",
    "volcanoes", "the Silk Road", "a robot learning to paint", "coffee", "the moon landing",
]
PROSE_FORMS = [
    "Write a short paragraph about {topic}.",
    "Write a four-line poem about {topic}.",
    "Describe {topic} to a ten-year-old in three sentences.",
    "Write the opening of a short story about {topic}.",
]
CHAT_TOPICS = [
    "staying focused while working from home", "planning a weekend trip", "starting to run",
    "cooking a healthy dinner quickly", "saving money each month", "preparing for a job interview",
    "keeping houseplants alive", "learning to play the guitar", "writing a good email", "making new friends",
    "organizing my desk", "choosing a first programming language", "sleeping better", "reading more books",
]
CHAT_FORMS = [
    "Hi! Can you give me three tips for {topic}?",
    "I need some advice on {topic}. Where should I start?",
    "What are common mistakes people make when {topic_ing}?",
    "Thanks for your help earlier. One more question: any ideas for {topic}?",
]


# One family per domain is held out whole (the last form of each list, and the extra JSON form).
HELD_OUT_FAMILIES = {"code-2", "math-5", "json-2", "prose-3", "chat-3"}


def main():
    rng = random.Random(0)
    rows = []

    def add(domain, form_index, prompt):
        family = f"{domain}-{form_index}"
        rows.append({"id": f"{domain}-{sum(r['domain'] == domain for r in rows):04d}", "domain": domain,
                     "family": family, "split": "held_out" if family in HELD_OUT_FAMILIES else "train",
                     "prompt": prompt})

    for task in CODE_TASKS:
        for i, form in enumerate(CODE_FORMS):
            add("code", i, form.format(lang=rng.choice(LANGS), task=task))
    for _ in range(120):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        i = rng.randrange(len(MATH_FORMS))
        add("math", i, MATH_FORMS[i].format(a=a, b=b, c=a * rng.randint(1, 9) + b))
    for entity, fields in ENTITIES:
        for i, form in enumerate(JSON_FORMS):
            add("json", i, form.format(entity=entity, fields=fields))
    for topic in TOPICS:
        for i, form in enumerate(PROSE_FORMS):
            add("prose", i, form.format(topic=topic))
    for topic in CHAT_TOPICS:
        for i, form in enumerate(CHAT_FORMS):
            add("chat", i, form.format(topic=topic, topic_ing=topic))
    # More JSON variety: the domain is small otherwise.
    for entity, fields in ENTITIES:
        for n in (1, 3):
            add("json", len(JSON_FORMS), f"Output {n} JSON object(s) for {entity}; keys: {fields}. No prose.")
    out = Path(__file__).resolve().parents[1] / "eval" / "data" / "prompts.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {out}")


if __name__ == "__main__":
    main()
