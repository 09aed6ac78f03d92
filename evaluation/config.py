"""`ctxcache eval`'s configuration: which model, which methods with which parameter grids, what to
measure (`EvalConfig`, read from TOML or JSON by `load_config`), and the runs a config expands to
(`expand_runs`: one `Run` per method and grid point). `evaluation/harness.py` runs them.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from decoder.model import DEFAULT_MODEL
from evaluation import tasks as T
from indexer.base import MethodParams, get_method, method_names

_FRACTION_OF_N = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*n\s*$")


class MethodSpec(BaseModel):
    """One method and its parameter grid: every combination of `grid` values, on top of `params`.

    An int parameter may be given relative to the context length as a string "0.05n"
    (= ceil(0.05 * n_ctx)), e.g. a streaming window matching a 5% budget at every length.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    label: str | None = Field(None, description="label prefix [method name]")
    params: dict[str, Any] = Field(default_factory=dict)
    grid: dict[str, list[Any]] = Field(default_factory=dict)


class FidelityConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lengths: list[int] = Field(default_factory=lambda: [2048], description="stored context lengths (tokens)")
    positions: int = Field(32, ge=1, le=4096, description="teacher-forced continuation tokens")
    queries: int = Field(8, ge=0, le=4096, description="continuation steps replayed at the attention level")
    recall_ratio: float = Field(0.05, gt=0.0, le=1.0, description="K of the exact top-K: ratio of the visible tokens")
    source: Literal["natural", "noise"] = Field("natural", description="document text: stdlib prose or RULER's noise")
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check(self):
        if self.queries > self.positions:
            raise ValueError("fidelity.queries must be <= fidelity.positions (queries come from the reference run)")
        if any(n < 16 for n in self.lengths):
            raise ValueError("fidelity.lengths must be >= 16 tokens")
        return self


class TaskConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(default_factory=lambda: ["niah_single_1"])
    lengths: list[int] = Field(default_factory=lambda: [512])
    samples: int = Field(2, ge=1, le=1000, description="samples per task and length; depths evenly spaced in [0, 1]")
    depths: list[float] | None = Field(None, description="explicit needle depths (overrides the even spacing)")
    seed: int = Field(0, ge=0)
    answer_prefix: bool = Field(True, description="start the answer with RULER's answer prefix")
    max_tokens: int | None = Field(None, ge=1, le=4096, description="override each task's generation length")

    @model_validator(mode="after")
    def _check(self):
        unknown = [n for n in self.names if n not in T.TASKS]
        if unknown:
            raise ValueError(f"unknown tasks {unknown}; known: {', '.join(T.TASKS)}")
        if self.depths is not None and not all(0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError("tasks.depths must lie in [0, 1]")
        return self

    def sample_depths(self) -> list[float]:
        return list(self.depths) if self.depths is not None else T.sample_depths(self.samples)


class EvalConfig(BaseModel):
    """One evaluation: model, where artifacts live, methods and their grids, what to measure.
    Relative paths are relative to the working directory."""

    model_config = ConfigDict(extra="forbid")

    name: str = "eval"
    model: str = Field(DEFAULT_MODEL, description="smollm2-135m, a .gguf file or an HF model directory")
    data_dir: Path = Field(Path("data/eval"), description="context store (data_dir/contexts), reused across runs")
    model_cache: Path | None = Field(None, description="where a GGUF model is converted once [data_dir]")
    torch_threads: int | None = Field(None, ge=1)
    prefill_chunk_tokens: int = Field(512, ge=16)
    dram_tier_bytes: int = Field(2 * 1024**3, ge=0)
    prompt_format: Literal["chat", "raw"] = "chat"
    methods: list[MethodSpec]
    fidelity: FidelityConfig | None = None
    tasks: TaskConfig | None = None

    @model_validator(mode="after")
    def _check(self):
        known = method_names()
        for m in self.methods:
            if m.name not in known:
                raise ValueError(f"unknown method {m.name!r}; known: {', '.join(known)}")
        runs = expand_runs(self.methods)
        labels = [r.label for r in runs]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"two runs share the label(s) {dup}; give them a distinct `label`")
        for r in runs:  # reject bad parameters before any work starts
            r.params_for(1024)
        return self


def load_config(path: Path | str) -> EvalConfig:
    path = Path(path)
    raw = path.read_text()
    data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw)
    return EvalConfig.model_validate(data)


@dataclass(frozen=True)
class Run:
    """One method with concrete (possibly length-relative) parameters."""

    label: str
    method: str
    raw_params: tuple[tuple[str, Any], ...]

    def params_for(self, n_ctx: int) -> MethodParams:
        method = get_method(self.method)
        resolved = {}
        for k, v in self.raw_params:
            m = _FRACTION_OF_N.match(v) if isinstance(v, str) else None
            resolved[k] = max(0, math.ceil(float(m.group(1)) * n_ctx)) if m else v
        try:
            return method.Params.model_validate(resolved)
        except ValidationError as e:
            raise ValueError(f"{self.label}: invalid parameters {resolved}: {e}") from None


def expand_runs(specs: list[MethodSpec]) -> list[Run]:
    runs = []
    for spec in specs:
        keys = sorted(spec.grid)
        for combo in itertools.product(*(spec.grid[k] for k in keys)) if keys else [()]:
            chosen = dict(zip(keys, combo))
            params = {**spec.params, **chosen}
            tag = ",".join(f"{k}={_fmt(v)}" for k, v in chosen.items())
            label = (spec.label or spec.name) + (f"[{tag}]" if tag else "")
            runs.append(Run(label, spec.name, tuple(sorted(params.items()))))
    return runs


def _fmt(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)
