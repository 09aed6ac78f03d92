"""RULER-style synthetic long-context tasks, re-implemented from RULER's definitions (no downloads).

RULER (NVIDIA/RULER, `scripts/data/synthetic/{niah,variable_tracking,freq_words_extraction}.py`,
`scripts/synthetic.yaml`, `scripts/eval/synthetic/constants.py`) defines:

* `niah`: needles "One of the special magic {numbers} for {key} is: {value}." inserted in a haystack:
  `repeat` = the noise sentence below, `essay` = natural prose (RULER: Paul Graham essays),
  `needle` = a haystack made only of distractor needles. Keys are adjective-noun words, values
  7-digit numbers. Variants (synthetic.yaml): single_1 (repeat), single_2 (essay), multikey_1 (essay,
  4 keys: 3 distractor needles), multikey_2 (needle haystack), multivalue (essay, 4 values for one
  key), multiquery (essay, 4 keys all asked). Scored by `string_match_all`.
* `vt` (variable tracking): one chain "VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE ", ... (4 hops, 5
  variables) hidden in the noise; the question asks for every variable holding the value.
  `string_match_all`.
* `fwe` (frequent words extraction): coded 6-letter words drawn from a zeta(alpha = 2) distribution
  over a vocabulary of n_tokens // 50 words, rank 1 replaced by the noise '...'; answer: ranks 2-4.
  `string_match_all`.

Scoring (RULER's `string_match_all` / `string_match_part`): case-insensitive substring match of each
reference in the prediction; `all` = fraction of the references found (RULER's partial credit),
`any` = 1 if any reference is found.

What differs from RULER, on purpose:
* The natural-text haystack is prose from the docstrings of this Python's standard library
  (`natural_sentences()`: paragraphs of English sentences only, read with `ast` from the source
  files, never imported), not Paul Graham's essays: it ships with every Python, so no download.
  It depends on the Python version; its sha256 is reported (`natural_source()`).
* Needle depths are evenly spaced, not sampled: a single needle sits at the sample's `depth` (a
  fraction of the haystack, sentence-aligned); the needles of a multi-needle sample at depths
  (j + 0.5) / m, shuffled by the seed. The harness spreads the sample depths evenly over [0, 1].
* Keys come from a fixed adjective x noun list in this file (RULER uses the `wonderwords` lists).
* The prompt is split for a write-once context: the preamble + haystack is the stored context; the
  question (and RULER's answer prefix, which the harness puts at the start of the assistant turn) is
  what is asked of it. The token length counted is the context's (`n_tokens(context)`), fitted to
  the largest haystack that does not exceed the target.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import math
import random
import re
import string
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."

ADJECTIVES = (
    "able ancient angry bitter bold brave bright broad calm careful cheap clever cold cool curious damp "
    "dark deep dizzy dry eager early easy empty fancy fast fierce flat fresh friendly gentle giant glad "
    "golden grumpy happy heavy hollow honest huge humble icy jolly kind large lazy little lively loud "
    "lucky mighty modern narrow neat noisy odd old orange plain polite proud purple quick quiet rapid "
    "rare rich rough round rusty sad salty sharp shiny short silent silly slow small smooth soft sour "
    "spicy steady sticky strange strong sunny sweet swift tall tame tender thin tiny tired tough warm "
    "wet wide wild windy wise witty young"
).split()
NOUNS = (
    "anchor apple arrow badge banana barrel basket beacon bell blanket bottle bridge bucket butter "
    "button cabin camera candle canyon carpet castle cherry circle cloud clover comet copper cradle "
    "crown crystal curtain dragon drum eagle engine falcon feather fence forest fountain garden "
    "garlic glacier guitar hammer harbor helmet island jacket jungle kettle ladder lantern lemon "
    "magnet marble meadow mirror monkey needle ocean orchard oyster paddle parrot pebble pencil "
    "pepper piano pillow planet pocket puzzle rabbit ribbon river rocket saddle shadow shelter "
    "spider spoon squirrel statue tablet teapot thunder tiger tomato tower trumpet tunnel turtle "
    "velvet violin wagon walnut whistle window zebra"
).split()

# RULER's templates (scripts/data/synthetic/constants.py), split into context / question / prefix.
NIAH_PREAMBLE = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_v} afterwards.\n")
NIAH_QUESTION = "What are all the special magic {type_v} for {query} mentioned in the provided text?"
NIAH_PREFIX = "The special magic {type_v} for {query} mentioned in the provided text are"
VT_PREAMBLE = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "Question: Find all variables that are assigned the value {query} in the text above."
VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
             "are assgined the value {query}, they are: ")  # sic: RULER's spelling
FWE_PREAMBLE = ("Read the following coded text and track the frequency of each coded word. "
                "Find the three most frequently appeared coded words. ")
FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. "
                "What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"


@dataclass
class TaskSample:
    """One task instance: a context to store, a question to ask of it, and the references."""

    task: str
    target_tokens: int
    seed: int
    depth: float | None  # single-needle depth (fraction of the haystack); None for other tasks
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    metric: str  # "all" | "any"
    max_tokens: int  # RULER's tokens_to_generate, capped for this model (see TASKS)
    needles: list[str] = field(default_factory=list)  # inserted needle sentences, in document order
    n_tokens: int = 0  # the context's token count

    def score(self, prediction: str) -> float:
        return score(prediction, self.answers, self.metric)


def score_all(prediction: str, references: list[str]) -> float:
    """RULER `string_match_all` for one sample: fraction of the references found (case-insensitive)."""
    p = prediction.lower()
    return sum(r.lower() in p for r in references) / len(references)


def score_any(prediction: str, references: list[str]) -> float:
    """RULER `string_match_part` for one sample: 1 if any reference is found (case-insensitive)."""
    p = prediction.lower()
    return float(any(r.lower() in p for r in references))


def score(prediction: str, references: list[str], metric: str) -> float:
    if metric == "all":
        return score_all(prediction, references)
    if metric == "any":
        return score_any(prediction, references)
    raise ValueError(f"unknown metric {metric!r} (all | any)")


# ---------------------------------------------------------------------------------------------
# Natural-text haystack: prose from the standard library's docstrings

_STDLIB_PACKAGES = ("asyncio", "collections", "concurrent", "email", "html", "http", "importlib", "json", "logging",
                    "multiprocessing", "sqlite3", "unittest", "urllib", "wsgiref", "xml")
_CODE_LIKE = re.compile(r">>>|::|\w\(|\)\s*->|=|_\w|\w_|[{}\[\]<>|*`#\\$%@~^]")
_SENTENCE_END = re.compile(r"(?<=[a-z0-9][.!?])\s+(?=[A-Z])")


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_") and p.stem not in ("this", "antigravity"))
    files += sorted(p for p in root.glob("*/*.py") if p.parent.name in _STDLIB_PACKAGES and not p.name.startswith("_"))
    return files


@functools.lru_cache(maxsize=1)
def natural_paragraphs() -> tuple[str, ...]:
    """Prose paragraphs from the docstrings of the standard library (parsed with `ast`, never
    imported): >= 12 words, ending in a period, no code-like characters, >= 93% letters/spaces;
    deduplicated, in a fixed file/definition order."""
    out: list[str] = []
    seen: set[str] = set()
    for f in _stdlib_files():
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        nodes = [tree] + [n for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not n.name.startswith("_")]
        for node in nodes:
            doc = ast.get_docstring(node)
            if not doc:
                continue
            for para in re.split(r"\n\s*\n", doc):
                para = " ".join(para.split())
                if len(para.split()) < 12 or not para.endswith(".") or _CODE_LIKE.search(para):
                    continue
                if sum(c.isalpha() or c == " " for c in para) / len(para) < 0.93 or para in seen:
                    continue
                seen.add(para)
                out.append(para)
    return tuple(out)


@functools.lru_cache(maxsize=1)
def natural_sentences() -> tuple[str, ...]:
    """Sentences of the paragraphs that read as prose: start upper-case, end . ! ?, no list dashes."""
    return tuple(s for p in natural_paragraphs() for s in _SENTENCE_END.split(p)
                 if s and s[0].isupper() and s[-1] in ".!?" and " -- " not in s and len(s.split()) >= 4)


def natural_source() -> dict:
    """Provenance of the natural-text haystack (it depends on the Python version)."""
    import sys

    text = " ".join(natural_sentences())
    return {"source": f"docstrings of the Python {sys.version.split()[0]} standard library (prose sentences)",
            "sentences": len(natural_sentences()), "words": len(text.split()),
            "sha256": hashlib.sha256(text.encode()).hexdigest()}


def natural_text(n_sentences: int, offset: int = 0) -> str:
    """`n_sentences` consecutive sentences from `offset` (wrapping around)."""
    sents = natural_sentences()
    return " ".join(sents[(offset + i) % len(sents)] for i in range(n_sentences))


# ---------------------------------------------------------------------------------------------
# Length fitting


def fit_units(build: Callable[[int], str], n_tokens: Callable[[str], int], target: int, lo: int = 1, hi: int = 64) -> int:
    """Largest haystack size u with n_tokens(build(u)) <= target (binary search; monotone in u)."""
    if n_tokens(build(lo)) > target:
        return lo
    while n_tokens(build(hi)) <= target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if n_tokens(build(mid)) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def _insert_at_depths(units: list[str], items: list[str], depths: list[float]) -> list[str]:
    """Insert items (in order of increasing depth) between haystack units, each at the unit boundary
    nearest to `depth` of the haystack's characters (units may differ in length, e.g. sentences)."""
    import bisect

    cum = [0]
    for u in units:
        cum.append(cum[-1] + len(u) + 1)
    total = max(cum[-1], 1)
    pairs = sorted(zip(depths, range(len(items))), key=lambda x: (x[0], x[1]))
    out, cursor = [], 0
    for depth, i in pairs:
        j = bisect.bisect_left(cum, depth * total)
        at = j if j == 0 or (j < len(cum) and cum[j] - depth * total < depth * total - cum[j - 1]) else j - 1
        at = max(at, cursor)
        out += units[cursor:at]
        out.append(items[i])
        cursor = at
    return out + units[cursor:]


def _random_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _random_number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


# ---------------------------------------------------------------------------------------------
# Generators


def niah(
    n_tokens: Callable[[str], int],
    target: int,
    *,
    seed: int = 0,
    depth: float = 0.5,
    haystack: str = "repeat",
    num_k: int = 1,
    num_v: int = 1,
    num_q: int = 1,
    task: str = "niah",
) -> TaskSample:
    """RULER niah. num_k keys (>= num_q) with num_v values each; num_q keys are asked for."""
    if haystack not in ("repeat", "essay", "needle"):
        raise ValueError(f"haystack must be repeat | essay | needle, not {haystack!r}")
    rng = random.Random(f"{task}-{seed}")
    num_k = max(num_k, num_q)
    type_v = "numbers"
    keys: list[str] = []
    while len(keys) < num_k:
        k = _random_key(rng)
        if k not in keys:
            keys.append(k)
    values = [[_random_number(rng) for _ in range(num_v)] for _ in keys]
    needles = [NEEDLE.format(type_v=type_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    if len(needles) == 1:
        depths = [depth]
    else:
        rng.shuffle(needles)
        depths = [(j + 0.5) / len(needles) for j in range(len(needles))]
    queried = rng.sample(range(num_k), num_q)
    answers = [v for i in queried for v in values[i]]
    query = ", ".join(keys[i] for i in queried[:-1]) + ", and " + keys[queried[-1]] if num_q > 1 else keys[queried[0]]
    if num_q * num_v == 1:  # RULER's singular rewrite
        preamble = NIAH_PREAMBLE.replace("Some", "A").replace("are", "is").format(type_v="number")
        question = NIAH_QUESTION.replace("are all", "is").format(type_v="number", query=query)
        prefix = NIAH_PREFIX.replace("are", "is").format(type_v="number", query=query)
    else:
        preamble = NIAH_PREAMBLE.format(type_v=type_v)
        question = NIAH_QUESTION.format(type_v=type_v, query=query)
        prefix = NIAH_PREFIX.format(type_v=type_v, query=query)
    offset = rng.randrange(len(natural_sentences())) if haystack == "essay" else 0
    distractors = [NEEDLE.format(type_v=type_v, key=_random_key(rng), value=_random_number(rng)) for _ in range(4096)] \
        if haystack == "needle" else []
    distractors = [d for d in distractors if not any(f" {k} " in d for k in keys)]

    def units(u: int) -> list[str]:
        if haystack == "repeat":
            return [NOISE] * u
        if haystack == "essay":
            return [natural_text(1, offset + i) for i in range(u)]
        return [distractors[i % len(distractors)] for i in range(u)]

    sep = "\n" if haystack != "essay" else " "

    def build(u: int) -> str:
        return preamble + sep.join(_insert_at_depths(units(u), needles, depths))

    u = fit_units(build, n_tokens, target)
    context = build(u)
    in_order = [needles[i] for _, i in sorted(zip(depths, range(len(needles))))]
    return TaskSample(task=task, target_tokens=target, seed=seed, depth=depth if len(needles) == 1 else None,
                      context=context, question=question, answer_prefix=prefix, answers=answers, metric="all",
                      max_tokens=12 * len(answers) + 8, needles=in_order, n_tokens=n_tokens(context))


def variable_tracking(n_tokens: Callable[[str], int], target: int, *, seed: int = 0, num_chains: int = 1,
                      num_hops: int = 4, task: str = "vt", **_) -> TaskSample:
    """RULER vt: chains VAR X0 = <5 digits>, VAR X1 = VAR X0, ... in the noise; asks for all X_i."""
    rng = random.Random(f"{task}-{seed}")
    n_vars = (num_hops + 1) * num_chains
    names: list[str] = []
    while len(names) < n_vars:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    chains = []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        chain = [f"VAR {vs[0]} = {rng.randint(10000, 99999)}"] + [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(num_hops)]
        chains.append((vs, chain))
    value = chains[0][1][0].split("=")[-1].strip()
    # RULER samples random sorted insertion points per chain (statements stay in chain order).
    items, depths = [], []
    for _, chain in chains:
        items += chain
        depths += sorted(rng.random() for _ in chain)

    def build(u: int) -> str:
        sents = _insert_at_depths([NOISE + "\n"] * u, items, depths)
        return (VT_PREAMBLE + " ".join(sents)).replace(". \n", ".\n")

    u = fit_units(build, n_tokens, target, lo=1)
    context = build(u)
    return TaskSample(task=task, target_tokens=target, seed=seed, depth=None, context=context,
                      question=VT_QUESTION.format(query=value),
                      answer_prefix=VT_PREFIX.format(num_v=num_hops + 1, query=value),
                      answers=list(chains[0][0]), metric="all", max_tokens=30, needles=chains[0][1],
                      n_tokens=n_tokens(context))


def _zeta(alpha: float, terms: int = 100000) -> float:
    """Riemann zeta by direct sum + the integral tail (alpha > 1)."""
    s = math.fsum(k ** -alpha for k in range(1, terms + 1))
    return s + terms ** (1 - alpha) / (alpha - 1)


def freq_words(n_tokens: Callable[[str], int], target: int, *, seed: int = 0, alpha: float = 2.0,
               word_len: int = 6, task: str = "fwe", **_) -> TaskSample:
    """RULER fwe: word of rank k appears int(W * k^-alpha / zeta(alpha)) times; rank 1 is '...'."""
    rng = random.Random(f"{task}-{seed}")
    vocab_size = max(8, target // 50)
    vocab: list[str] = []
    while len(vocab) < vocab_size:
        w = "".join(rng.choices(string.ascii_lowercase, k=word_len))
        if w not in vocab:
            vocab.append(w)
    vocab[0] = "..."
    z = _zeta(alpha)

    def build(num_words: int) -> str:
        counts = [int(num_words * (k ** -alpha) / z) for k in range(1, vocab_size + 1)]
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(f"{task}-shuffle-{seed}").shuffle(words)
        return FWE_PREAMBLE + " ".join(words)

    w = fit_units(build, n_tokens, target, lo=8, hi=256)
    context = build(w)
    return TaskSample(task=task, target_tokens=target, seed=seed, depth=None, context=context, question=FWE_QUESTION,
                      answer_prefix=FWE_PREFIX, answers=vocab[1:4], metric="all", max_tokens=24, needles=[],
                      n_tokens=n_tokens(context))


# name -> (generator, RULER's arguments from synthetic.yaml)
TASKS: dict[str, tuple[Callable[..., TaskSample], dict]] = {
    "niah_single_1": (niah, {"haystack": "repeat"}),
    "niah_single_2": (niah, {"haystack": "essay"}),
    "niah_multikey_1": (niah, {"haystack": "essay", "num_k": 4}),
    "niah_multikey_2": (niah, {"haystack": "needle"}),
    "niah_multivalue": (niah, {"haystack": "essay", "num_v": 4}),
    "niah_multiquery": (niah, {"haystack": "essay", "num_q": 4}),
    "vt": (variable_tracking, {"num_chains": 1, "num_hops": 4}),
    "fwe": (freq_words, {"alpha": 2.0}),
}


def task_names() -> list[str]:
    return list(TASKS)


def make_sample(name: str, n_tokens: Callable[[str], int], target: int, *, seed: int = 0, depth: float = 0.5) -> TaskSample:
    try:
        gen, args = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}") from None
    return gen(n_tokens, target, seed=seed, depth=depth, task=name, **args)


def sample_depths(n: int) -> list[float]:
    """Evenly spaced depths in [0, 1] (one sample: the middle)."""
    return [0.5] if n == 1 else [i / (n - 1) for i in range(n)]
