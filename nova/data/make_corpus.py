"""Generate ``corpus.txt``, the built-in training text, from a small grammar.

Nova never downloads data, so it ships its own. The text is made, not
collected: short fables from a hand-written grammar, seeded, so the file is
reproducible byte for byte (``python -m nova.data.make_corpus`` rewrites it).
It has structure at several ranges, which is what makes a falling loss mean
something: spelling and word frequencies (a unigram/bigram model gets these),
sentence templates and agreement (a few tokens of context), and each story's
hero and place recurring across its sentences (only attention over the whole
block can copy those).
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = ["Ada", "Bram", "Cleo", "Dov", "Esme", "Finn", "Greta", "Hugo", "Iris", "Jonah",
         "Kira", "Leo", "Mila", "Nico", "Olga", "Pip", "Quinn", "Rosa", "Sami", "Tess",
         "Ulla", "Vik", "Wren", "Yara", "Zed"]
ANIMALS = ["fox", "owl", "hare", "badger", "crow", "otter", "mouse", "heron", "wolf",
           "bear", "goat", "tortoise", "beetle", "swan", "deer"]
ADJ = ["small", "old", "clever", "quiet", "brave", "tired", "curious", "gentle", "proud",
       "hungry", "patient", "restless", "kind", "grey", "young"]
PLACE_ADJ = ["quiet", "old", "green", "misty", "sunny", "far", "cold", "busy", "hidden", "windy"]
PLACES = ["forest", "valley", "village", "river bank", "hill", "marsh", "meadow",
          "orchard", "harbour", "mill", "garden", "cave"]
OBJECTS = ["lantern", "basket", "key", "map", "kettle", "rope", "book", "bell", "coat",
           "boat", "ladder", "drum", "letter", "compass", "loaf"]
WEATHER = ["the rain fell all day", "the wind was cold", "the sun was warm",
           "snow covered the ground", "fog hid the path", "the sky was clear"]
# (present-tense base, past tense) so one verb can be used in both tenses.
VERBS = [("find", "found"), ("carry", "carried"), ("mend", "mended"), ("hide", "hid"),
         ("share", "shared"), ("lose", "lost"), ("paint", "painted"), ("guard", "guarded")]
MOVES = ["walked", "ran", "wandered", "hurried", "climbed", "crept"]
MORALS = ["Slow work is still work.", "A friend in need is a friend indeed.",
          "Pride comes before a fall.", "Many hands make light work.",
          "Look before you leap.", "Honesty is the best policy.",
          "Kindness costs nothing.", "Patience is a kind of courage."]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                "nine", "ten", "eleven", "twelve"]


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def plural(word: str, n: int) -> str:
    if n == 1:
        return word
    return word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")


def story(rng: random.Random) -> str:
    """One fable: a hero, a friend, a place and an object that recur throughout."""
    hero, friend = rng.sample(NAMES, 2)
    animal, friend_animal = rng.sample(ANIMALS, 2)
    adj, friend_adj = rng.sample(ADJ, 2)
    place, other_place = rng.sample(PLACES, 2)
    place_adj = rng.choice(PLACE_ADJ)
    obj = rng.choice(OBJECTS)
    base, past = rng.choice(VERBS)
    n = rng.randint(2, 9)
    s = [f"Once upon a time, in {article(place_adj)} {place_adj} {place}, there lived "
         f"{article(adj)} {adj} {animal} named {hero}."]
    s.append(f"{hero} the {animal} had {NUMBER_WORDS[n]} {plural(obj, n)} and wanted one more.")
    for _ in range(rng.randint(1, 3)):
        pick = rng.random()
        if pick < 0.3:
            s.append(f"One morning {rng.choice(WEATHER)}, so {hero} {rng.choice(MOVES)} "
                     f"to the {other_place}.")
        elif pick < 0.6:
            s.append(f"There {hero} met {friend}, {article(friend_adj)} {friend_adj} "
                     f"{friend_animal}.")
            s.append(f'"Will you help me {base} the {obj}?" asked {hero}.')
            s.append(rng.choice([f'"Yes," said {friend}, "I will help you."',
                                 f'"No," said {friend}, "I am too busy."']))
        else:
            m = rng.randint(1, 6)
            k = rng.randint(1, 6)
            s.append(f"{hero} counted {NUMBER_WORDS[m]} and {NUMBER_WORDS[k]}, which makes "
                     f"{NUMBER_WORDS[m + k]}.")
    s.append(f"In the end the {animal} {past} the {obj}, and {friend} the {friend_animal} "
             f"went home to the {place}.")
    s.append(f"Moral: {rng.choice(MORALS)}")
    return " ".join(s)


def make_corpus(num_bytes: int = 300_000, seed: int = 1234) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_bytes:
        parts.append(story(rng))
        size += len(parts[-1]) + 2
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    out = Path(__file__).with_name("corpus.txt")
    out.write_text(make_corpus(), encoding="utf-8")
    print(f"wrote {out} ({out.stat().st_size} bytes)")
