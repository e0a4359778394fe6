"""Generate the shipped review-sentiment dataset (data/reviews-*.jsonl), deterministically.

Template sentences about films, books and restaurants, labelled 1 (positive) or 0 (negative), with
negation ("not great" is negative) and mixed clauses so a model has something to learn. Written for
this project; free to redistribute. Run: python data/generate.py
"""

import json
import random
from pathlib import Path

SUBJECTS = ["the film", "this movie", "the plot", "the acting", "the soundtrack", "the book", "this novel",
            "the ending", "the restaurant", "the service", "the food", "the dessert", "the staff", "the hotel room",
            "the sequel", "the main character", "the dialogue", "the camera work", "the pacing", "the menu"]
POSITIVE = ["wonderful", "brilliant", "delightful", "moving", "excellent", "charming", "superb", "gripping",
            "fresh", "memorable", "beautiful", "clever", "warm", "stunning", "great"]
NEGATIVE = ["dull", "awful", "boring", "clumsy", "terrible", "bland", "tedious", "forgettable", "messy",
            "disappointing", "weak", "cold", "lifeless", "painful", "poor"]
INTENSIFIERS = ["", "really ", "truly ", "quite ", "absolutely ", "rather ", "so "]
OPENERS = ["", "honestly, ", "to be fair, ", "overall, ", "in the end, ", "i thought ", "my friends said "]
CONTRAST = ["but", "although", "even though", "yet"]


def clause(rng: random.Random, positive: bool) -> str:
    negate = rng.random() < 0.25
    words = POSITIVE if positive != negate else NEGATIVE
    verb = "was not" if negate else rng.choice(["was", "is", "felt", "seemed"])
    return f"{rng.choice(SUBJECTS)} {verb} {rng.choice(INTENSIFIERS)}{rng.choice(words)}"


def sentence(rng: random.Random) -> tuple[str, int]:
    label = rng.randint(0, 1)
    main = clause(rng, positive=bool(label))
    if rng.random() < 0.35:  # a weaker clause of the other sentiment, subordinate to the main one
        text = f"{clause(rng, positive=not label)}, {rng.choice(CONTRAST)} overall {main}"
    else:
        text = main
        if rng.random() < 0.4:
            text += f" and {clause(rng, positive=bool(label))}"
    return (rng.choice(OPENERS) + text + rng.choice([".", "!", ".", "..."])), label


def write(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(count):
            text, label = sentence(rng)
            handle.write(json.dumps({"text": text, "label": label}) + "\n")


if __name__ == "__main__":
    here = Path(__file__).parent
    write(here / "reviews-train.jsonl", 2000, seed=1)
    write(here / "reviews-eval.jsonl", 256, seed=2)
