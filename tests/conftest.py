"""Shared fixtures. GPU skips live here, in one place, with their reason."""

from __future__ import annotations

import fcntl
import os
import uuid
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# Converted model cache shared by test runs (GGUF parsing takes ~17 s; the cache reloads in 0.1 s).
MODEL_CACHE = Path(os.environ.get("CTXCACHE_TEST_MODEL_CACHE", ROOT / ".cache" / "test-data"))
REDIS_URL = os.environ.get("CTXCACHE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

HAS_CUDA = torch.cuda.is_available()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs the suite in worker processes (pytest-xdist, one per core on CI): one torch
    # thread each, since OpenMP threads spin-waiting for a core another worker holds make every small
    # op several times slower (see `one_torch_thread`).
    torch.set_num_threads(1)
GPU_SKIP_REASON = "no CUDA device on this machine (CPU CI); GPU paths run on the device tool, see benchmarks/"
if not HAS_CUDA:
    # Triton kernels run through Triton's interpreter on CPU tensors (tests/test_triton_attention.py):
    # CI checks the kernels' logic without a GPU. Read when a kernel module is imported, so set first.
    os.environ.setdefault("TRITON_INTERPRET", "1")


INTERPRETER_SKIP_REASON = "runs Triton's CPU interpreter (emulating a GPU's program order); this machine compiles for its GPU"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    skipped = 0
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
            skipped += 1
        if "interpreter" in item.keywords and HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason=INTERPRETER_SKIP_REASON))
    if skipped:
        config._ctxcache_gpu_skipped = skipped


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = getattr(config, "_ctxcache_gpu_skipped", 0)
    if n:
        terminalreporter.write_line(f"ctxcache: {n} GPU test(s) SKIPPED: {GPU_SKIP_REASON}", yellow=True, bold=True)


@pytest.fixture(autouse=True)
def _worker_stays_on_one_thread():
    """In an xdist worker, put torch back on one thread after any test that changed it (an eval
    config's `torch_threads`, a CLI run): the setting is process-wide, and every later test of the
    worker would otherwise run oversubscribed (the eval smoke fixture took 141 s in the suite after
    its config set 2 threads, 18 s alone)."""
    yield
    if os.environ.get("PYTEST_XDIST_WORKER") and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Pin torch to one intra-op thread for a module (`pytestmark = pytest.mark.usefixtures(...)`).
    On 2 shared cores, OpenMP spin-waiting on a busy second core makes the methods' many small ops
    several times slower with 2 threads (measured: test_csattn took 11 min with 2, a 30-layer 1K-token
    prefill 22.9 s vs 5.6 s, a SAAP training step 53 ms vs 13 ms)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def lm():
    """The default model (SmolLM2-135M-Instruct), float32 on the CPU."""
    from decoder.model import load_model

    return load_model("smollm2-135m", MODEL_CACHE)


PASSKEY_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_document(key: int, n_rep: int = 20, depth: float = 0.5) -> str:
    """~560 tokens with the default model at n_rep=20 (it answers this 5/5 with full attention)."""
    k = int(n_rep * depth)
    return (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n"
        + PASSKEY_NOISE * k
        + f"The pass key is {key}. Remember it. {key} is the pass key. "
        + PASSKEY_NOISE * (n_rep - k)
    )


PASSKEY_QUESTION = "What is the pass key?"


def natural_document(n_words: int = 1100) -> str:
    """A deterministic prose-like document (~1.5K tokens at 1100 words), built offline."""
    import random

    rng = random.Random(1234)
    subjects = ["The engineer", "A reviewer", "The scheduler", "Our team", "The cache", "Each worker", "The index"]
    verbs = ["records", "compresses", "inspects", "rebuilds", "forwards", "validates", "summarizes"]
    objects = ["the manifest", "every chunk", "the attention map", "a long prompt", "the key table",
               "recent tokens", "the query log", "a spare buffer"]
    tails = ["before noon.", "after each request.", "in the second pass.", "without delay.",
             "when memory runs low.", "for the nightly report.", "under heavy load."]
    words: list[str] = []
    while len(words) < n_words:
        words += f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}".split()
    return " ".join(words[:n_words])


@pytest.fixture(scope="session")
def captured_2k(lm):
    """Real post-RoPE Q/K/V of the default model over a ~2K-token document (captured once)."""
    from decoder.prefill import prefill

    ids = lm.context_ids(natural_document(1750))[:2048]
    return prefill(lm, ids)


@pytest.fixture(scope="session")
def saap_small_model(lm) -> Path:
    """The `small` SAAP preset trained on every layer (~100 s at 1 thread here), cached next to the
    converted model like it. The cache key is the sha256 of the training code and the settings, so
    a change to either trains again instead of reusing a stale model."""
    import hashlib

    from training.loop import train_saap
    from training.settings import settings_from

    settings = settings_from("small")
    h = hashlib.sha256(settings.model_dump_json().encode())
    for src in [*sorted((ROOT / "training").glob("*.py")), ROOT / "indexer/saap.py", ROOT / "indexer/clustering.py"]:
        h.update(src.read_bytes())
    out = MODEL_CACHE / "saap" / f"small-{h.hexdigest()[:16]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers: one trains, the others wait and reuse it
        if not (out / "manifest.json").exists():
            n = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                train_saap(lm, settings, out_dir=out, progress=False)
            finally:
                torch.set_num_threads(n)
    return out


@pytest.fixture
def redis_prefix():
    """A key prefix unique to one test; every key under it is deleted afterwards."""
    import redis

    prefix = f"ctxtest:{uuid.uuid4().hex[:10]}:"
    yield prefix
    r = redis.Redis.from_url(REDIS_URL)
    keys = list(r.scan_iter(match=prefix + "*", count=1000))
    if keys:
        r.delete(*keys)

