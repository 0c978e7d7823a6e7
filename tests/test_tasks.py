"""sparse_attn.tasks: the long-context task suite's generators and scorer
(no model: a whitespace "tokenizer" counts tokens)."""
import collections
import json
import re

import pytest

from sparse_attn import tasks


def count(text):
    return len(text.split())


@pytest.mark.parametrize("name", tasks.TASKS)
def test_deterministic_sized_and_answerable(name):
    a = tasks.generate(name, 2000, count, seed=5, depth=0.4)
    b = tasks.generate(name, 2000, count, seed=5, depth=0.4)
    c = tasks.generate(name, 2000, count, seed=6, depth=0.4)
    assert (a.context, a.question, a.prefix, a.expected) == \
        (b.context, b.question, b.prefix, b.expected)
    assert a.context != c.context and a.expected != c.expected
    assert 1900 <= count(a.context) <= 2300, count(a.context)
    assert a.expected and all(tasks.normalise(e) for e in a.expected)
    for item in a.expected:     # every expected item is in the context
        assert item in a.context, item
    assert tasks.score(a, " ".join(a.expected)) == 1.0


def test_niah_needles_keys_and_depth():
    t = tasks.generate("niah_single", 3000, count, seed=1, depth=0.25)
    (value,) = t.expected
    key = re.search(r"for (\w+)\?", t.question).group(1)
    at = t.context.index(f"The special magic number for {key} is: {value}.")
    assert abs(at / len(t.context) - 0.25) < 0.03
    assert t.context.count("special magic number") == 1
    mk = tasks.generate("niah_multikey", 3000, count, seed=1)
    found = re.findall(r"The special magic number for (\w+) is: (\d+)\.", mk.context)
    assert len(found) == 4 and len({k for k, _ in found}) == 4  # three distractor keys
    asked = re.search(r"for (\w+)\?", mk.question).group(1)
    assert dict(found)[asked] == mk.expected[0]
    mv = tasks.generate("niah_multivalue", 3000, count, seed=1)
    assert len(mv.expected) == 4 and mv.context.count("One of the special magic numbers") == 4
    mq = tasks.generate("niah_multiquery", 3000, count, seed=1)
    keys = mq.question[len("What are the special magic numbers for "):-1].split(", ")
    pairs = dict(re.findall(r"The special magic number for (\w+) is: (\d+)\.", mq.context))
    assert [pairs[k] for k in keys] == mq.expected


def test_variable_tracking_chain_in_order_among_others():
    t = tasks.generate("vt", 3000, count, seed=2, depth=0.1)
    value = re.search(r"value (\d+)", t.question).group(1)
    assigned = re.findall(r"VAR (\w+) = (VAR (\w+)|\d+)\.", t.context)
    holds, order = {}, []
    for name, rhs, src in assigned:
        holds[name] = holds[src] if src else rhs
        order.append(name)
    assert sorted(n for n, v in holds.items() if v == value) == sorted(t.expected)
    assert len(holds) == 15 and len(set(holds.values())) == 3   # three chains of five
    first = [order.index(n) for n in t.expected]
    assert first == sorted(first)                # each assignment after its source


def test_common_and_frequent_words_are_strictly_the_top():
    for budget in (600, 4000, 20000):
        t = tasks.generate("cwe", budget, count, seed=3)
        words = re.findall(r"\d+\. (\w+)", t.context)
        counts = collections.Counter(words)
        top = counts.most_common()
        assert {w for w, _ in top[:10]} == set(t.expected)
        assert top[9][1] > top[10][1]
        assert abs(count(t.context) - budget) < 0.15 * budget + 40
    for seed in range(20):
        t = tasks.generate("fwe", 1500, count, seed=seed)
        text = t.context.split("word. ", 1)[1].split()
        top = collections.Counter(text).most_common(4)
        assert [w for w, _ in top[:3]] == t.expected
        assert top[0][1] > top[1][1] > top[2][1] > top[3][1]


def test_key_values_are_a_json_object_with_the_key():
    t = tasks.generate("kv", 2000, count, seed=4)
    pairs = json.loads(t.context[len("JSON data: "):])
    key = re.search(r'key "([0-9a-f-]+)"', t.question).group(1)
    assert pairs[key] == t.expected[0] and len(pairs) > 100
    assert len(set(pairs.values())) == len(pairs)


def test_score_is_the_share_of_items_found():
    t = tasks.Task("x", "", "", "", ["4127", "Flowerpot", "EMBER", "lily"])
    assert tasks.score(t, "4,127; the red flower pot. ember and LILY") == 1.0
    assert tasks.score(t, "") == 0.0
    assert tasks.score(t, "I do not know") == 0.0
    assert tasks.score(t, "ember 4127") == 0.5
    assert tasks.score(t, "Lily.") == 0.25


def test_refuses_unknown_task_and_builds_a_chat_prompt():
    with pytest.raises(ValueError, match="task must be one of"):
        tasks.generate("needle", 100, count)

    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [hash(w) % 1000 for w in text.split()]}

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return f"<user>{messages[0]['content']}</user><assistant>"

    ids, task = tasks.build_task_prompt(Tokenizer(), "niah_multikey", 800, seed=9)
    assert task.name == "niah_multikey" and 800 <= len(ids) <= 900
    again, _ = tasks.build_task_prompt(Tokenizer(), "niah_multikey", 800, seed=9)
    assert ids == again
