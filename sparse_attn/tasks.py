"""Long-context tasks beyond one needle, generated locally from a seed:
what ``sparse-attn eval --suite`` asks a model (issue 65; RULER's task
kinds, built from this module's own word lists, no download).

Each task is a context of about n tokens, a question at its end, and the
start of the assistant's answer, with the items a right answer contains:

  niah_single     one "special magic number" for a key among filler sentences
  niah_multikey   the same, with needles of three other keys around it
  niah_multivalue four numbers for one key, asked together
  niah_multiquery the numbers of three keys, asked together
  vt              variable tracking: a chain of ``VAR X = VAR Y`` assignments
                  from one value across the context, among other chains;
                  asked for every variable that holds the value
  cwe             common words: a numbered list of words in which ten appear
                  many times; asked for those ten
  fwe             frequent words: a text of coded words drawn from a Zipf
                  law; asked for the three most frequent
  kv              key-value retrieval over many UUID-like pairs in a JSON
                  object; asked for one key's value

A generation scores the share of the expected items it contains, each
compared lower-cased with everything but letters and digits removed
(:func:`score`): all of them 1, none 0.  Deterministic: the same task,
length, seed and tokenizer give the same token ids.
"""
import json
import random
import re

from .needles import FILLERS

# Nouns for keys, variables and word lists (lower case, distinct).
WORDS = """
anchor apple arrow badge bakery ballad bamboo banner barrel basket beacon berry
blanket blossom bonnet bottle bracket breeze bridge bucket buffalo butter cabin
cactus candle canoe canyon carpet castle cedar cellar chapel cherry chimney
cinder circus citrus clover cobalt comet compass copper coral cotton cradle
crater crystal cup dagger daisy delta desert diamond dolphin dragon drum eagle
ember engine falcon feather fern fiddle flannel flute forest fossil fountain fox
galaxy garnet glacier goblet granite gravel gull hammer harbor harp hazel helmet
hickory honey hornet iris island ivory jacket jasmine jigsaw jungle kayak kernel
kettle kite ladder lagoon lantern lava lemon lily linen lobster locket maple
marble meadow mirror mitten monsoon mosaic moss muffin nectar needle nickel
oasis ocean olive onyx orbit orchid otter oyster paddle palace panther parcel
pebble pepper pillow pine planet plum pocket pollen pony poppy prairie prism
pumpkin puzzle quartz quill rabbit radish raven reef ribbon ridge river rocket
saddle saffron salmon satin scroll shadow shell shovel silk sketch sparrow spruce
stable star stone summit swan tablet tangle teapot thistle thunder tiger timber
topaz torch tulip tunnel turtle velvet violet voyage wagon walnut walrus whistle
willow window wizard wool yarn zephyr
""".split()

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe",
         "fwe", "kv")


class Task:
    """One generated task: ``context`` (the user's text before the
    question), ``question``, ``prefix`` (the assistant answer's start; its
    last token is the first decode step) and ``expected`` (the items a right
    answer contains)."""

    __slots__ = ("name", "context", "question", "prefix", "expected")

    def __init__(self, name, context, question, prefix, expected):
        self.name, self.context, self.question = name, context, question
        self.prefix, self.expected = prefix, list(expected)

    def __repr__(self):
        return f"Task({self.name!r}, {len(self.context)} characters, expected={self.expected})"


def normalise(text):
    return re.sub(r"[^a-z0-9]", "", str(text).lower())


def score(task, text):
    """The share of ``task.expected`` found in the generated ``text``."""
    got = normalise(text)
    return sum(normalise(e) in got for e in task.expected) / len(task.expected)


def _number(rng):
    return str(rng.randrange(1_000_000, 10_000_000))


def _haystack(rng, budget, count, filler):
    """Filler sentences until ``count`` says they hold ``budget`` tokens."""
    make, out, used = FILLERS[filler], [], 0
    while used < budget:
        out.append(make(rng))
        used += count(" " + out[-1])
    return out


def _insert(rng, sentences, needles, depth):
    """The needles placed among the sentences: the first at relative
    ``depth`` (None: anywhere), the others at random places."""
    for i, needle in enumerate(needles):
        d = depth if i == 0 and depth is not None else rng.random()
        sentences.insert(int(round(d * len(sentences))), needle)
    return sentences


def _magic(key, value, one_of=False):
    return (f"One of the special magic numbers for {key} is: {value}." if one_of
            else f"The special magic number for {key} is: {value}.")


def _niah(rng, budget, count, filler, depth, keys, values_per_key, asked):
    needles, expected = [], []
    for i, key in enumerate(keys):
        values = [_number(rng) for _ in range(values_per_key)]
        needles += [_magic(key, v, values_per_key > 1) for v in values]
        if i < asked:
            expected += values
    cost = sum(count(" " + n) for n in needles)
    hay = _haystack(rng, max(budget - cost, 0), count, filler)
    if asked == 1 and len(keys) > 1:        # the asked key's needle at the depth
        return _insert(rng, hay, needles, depth), expected
    head, rest = needles[:values_per_key * asked], needles[values_per_key * asked:]
    rng.shuffle(rest)
    return _insert(rng, hay, head + rest, depth), expected


def generate(name, budget, count, *, seed=0, depth=None, filler="facts"):
    """The task ``name`` with a context of about ``budget`` tokens as
    ``count(text)`` counts them, from ``seed`` (the needle of the niah tasks
    and the chain of vt start at relative ``depth`` when it is given)."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {name!r}")
    rng = random.Random(f"{name}:{seed}")
    if name.startswith("niah"):
        keys = rng.sample(WORDS, 4)
        shape = {"niah_single": (keys[:1], 1, 1), "niah_multikey": (keys, 1, 1),
                 "niah_multivalue": (keys[:1], 4, 1), "niah_multiquery": (keys[:3], 1, 3)}
        ks, per_key, asked = shape[name]
        sentences, expected = _niah(rng, budget, count, filler, depth, ks, per_key, asked)
        if asked > 1:
            names = ", ".join(ks[:asked])
            question = f"What are the special magic numbers for {names}?"
            prefix = f"The special magic numbers for {names} are:"
        elif per_key > 1:
            question = f"What are all the special magic numbers for {ks[0]}?"
            prefix = f"The special magic numbers for {ks[0]} are:"
        else:
            question = f"What is the special magic number for {ks[0]}?"
            prefix = f"The special magic number for {ks[0]} is:"
        return Task(name, " ".join(sentences), question, prefix, expected)
    if name == "vt":
        return _variable_tracking(rng, budget, count, filler, depth)
    if name == "cwe":
        return _common_words(rng, budget, count)
    if name == "fwe":
        return _frequent_words(rng, budget, count)
    return _key_values(rng, budget, count)


def _variable_tracking(rng, budget, count, filler, depth, hops=4, chains=3):
    names = iter(rng.sample([w.upper() for w in WORDS], hops * chains + chains))
    statements, asked = [], None
    for c in range(chains):
        value, chain = _number(rng), [next(names) for _ in range(hops + 1)]
        lines = [f"VAR {chain[0]} = {value}."] + \
            [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        if c == 0:
            asked = (value, chain)
        statements.append(lines)
    cost = sum(count(" " + s) for lines in statements for s in lines)
    hay = _haystack(rng, max(budget - cost, 0), count, filler)
    # each chain in order at increasing places: the asked one from `depth`
    for c, lines in enumerate(statements):
        start = depth if c == 0 and depth is not None else rng.random() * 0.5
        places = sorted(start + (1 - start) * rng.random() for _ in lines)
        for s, p in sorted(zip(lines, places), key=lambda t: t[1], reverse=True):
            hay.insert(int(round(p * len(hay))), s)
    value, chain = asked
    return Task("vt", " ".join(hay),
                f"Find all variables that are assigned the value {value} in the text above.",
                f"The variables assigned the value {value} are:", chain)


def _coded_words(rng, n, avoid=()):
    """n distinct made-up words of three consonant-vowel syllables."""
    out, seen = [], set(avoid)
    while len(out) < n:
        w = "".join(rng.choice("bcdfghjklmnprstvz") + rng.choice("aeiou") for _ in range(3))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def _common_words(rng, budget, count, n_common=10, rare_times=3):
    common = rng.sample(WORDS, n_common)
    entries = max(budget // max(count(" 100. " + common[0]), 1), 4 * n_common)
    common_times = min(max(entries // (2 * n_common), 4), 30)
    words = [w for w in common for _ in range(common_times)]
    n_rare = max(entries - len(words), 0) // rare_times
    pool = [w for w in WORDS if w not in common]
    rare = rng.sample(pool, min(n_rare, len(pool)))
    rare += _coded_words(rng, n_rare - len(rare), WORDS)
    words += [w for w in rare for _ in range(rare_times)]
    rng.shuffle(words)
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    return Task("cwe", "Below is a numbered list of words. " + listing,
                f"What are the {n_common} most common words in the list above?",
                f"The {n_common} most common words in the list are:", common)


def _frequent_words(rng, budget, count, alpha=2.0, top=3):
    vocab = _coded_words(rng, 120)
    weights = [1.0 / (r + 1) ** alpha for r in range(len(vocab))]
    n = max(budget // max(count(" " + vocab[0]), 1), 60)
    text = rng.choices(vocab, weights, k=n)
    used = {w: text.count(w) for w in vocab}
    ranked = sorted(vocab, key=lambda w: (-used[w], vocab.index(w)))
    if len({used[w] for w in ranked[:top + 1]}) < top + 1:   # a tie at the top: break it
        text += [ranked[i] for i in range(top) for _ in range(top - i)]
        rng.shuffle(text)
    return Task("fwe", "Read the following coded text and track the frequency of each coded "
                "word. " + " ".join(text),
                f"What are the {top} most frequently appearing coded words in the text above?",
                f"The {top} most frequent coded words are:", ranked[:top])


def _uuid(rng):
    h = "%032x" % rng.getrandbits(128)
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _key_values(rng, budget, count):
    pair_cost = max(count(json.dumps({_uuid(rng): _uuid(rng)})), 1)
    n = max(budget // pair_cost, 2)
    pairs = {_uuid(rng): _uuid(rng) for _ in range(n)}
    key = rng.choice(list(pairs))
    return Task("kv", "JSON data: " + json.dumps(pairs),
                f"What is the value associated with the key \"{key}\" in the JSON data above?",
                f"The value associated with the key \"{key}\" is:", [pairs[key]])


def build_task_prompt(tokenizer, name, n_tokens, *, seed=0, depth=None, filler="facts"):
    """(token ids of the chat prompt, the :class:`Task`): the task's context
    sized to about ``n_tokens`` tokens of ``tokenizer``, the question, and
    the assistant turn opened with the task's answer prefix."""
    def count(text):
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    task = generate(name, n_tokens, count, seed=seed, depth=depth, filler=filler)
    messages = [{"role": "user", "content": task.context + "\n\n" + task.question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text + task.prefix, add_special_tokens=False)["input_ids"], task
