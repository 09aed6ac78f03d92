"""What a SAAP training run is asked to do (`TrainSettings`), its presets, and where it computes.

`settings_from(preset, **overrides)` is how the CLI (`ctxcache train saap`), the REST route
(`POST /v1/methods/saap/train`) and the tests build settings. Every field but `device` is part of
the trained model's identity (the settings hash in each layer checkpoint and in the manifest, and
the REST job id): `training/loop.py` hashes `model_dump()`, and `device` is `exclude=True`.

Deviations from the paper (defaults; `settings_from(preset, **PAPER)` trains the paper's form:
`target="query_mass", residual=False`, with its query filter). They came from measuring why the
paper's form lost to plain centroid probing in the deep layers of SmolLM2-135M, then why a model
that won on attention mass missed the passkey (benchmarks/RESULTS_saap.md: "Summary", "Task level",
"Previous revision: why the classifier lost in deep layers"):
  * `target="group_mass"` instead of Eq. 1's per-query mass (`query_mass`). The decode ranks
    buckets by the *sum over the GQA group* of f_q's outputs (paper §5), but Eq. 1 trains each head
    on its own attention normalized over the long-range keys, so a head that puts little of its
    attention there counts as much as one that puts most of it there. The group targets
    (`training/classifier.py::long_range_target`) train what the decode ranks. `group_density`
    (the default before the passkey check) divides each bucket's mass by its number of long-range
    keys: it won more layers on held-out prose but misses the passkey (the needle's few digit
    tokens share buckets with filler, whose density is low).
  * `residual`: f_q's logits = q'·c / sqrt(D) + MLP(q'), the MLP's output layer initialized to 0,
    so the untrained classifier *is* centroid probing and training moves away from it only where
    the corpus says so. (The paper's App. E.1 found a residual *MLP* no better; this is a
    different residual: onto the k-means baseline.) Stored as the layer's `centroid_scale`.
  * `min_distance` (None) = the decode's dense part for a context of one window
    (`SaapParams.recent_for(doc_tokens)`). Keys between the dense part and min_distance are probed
    through buckets at decode, so training must cover them (a fixed 128 left out much of the
    attention mass beyond a 32-token dense part). The `full` preset keeps the paper's 1024.

Presets (`PRESETS`; their measured times: benchmarks/RESULTS_saap.md, "Training" and "Training on
a GPU"):
  * `full` (the paper's sizes, adapted to this model): C = 1024 clusters, hidden 1024, 40,000 Adam
    steps of 1,000 queries at lr 1e-5, windows of 8,192 tokens (SmolLM2's maximum; the paper used
    40 prompts of 500K tokens), 40 windows, min_distance 1024, fp16 capture cache. Meant for a GPU:
    on a CPU it takes days (`service/limits.py::train_cost` estimates it before a job starts).
  * `small` (minutes on one CPU thread): C = 32, hidden 128, 300 steps of 256 queries
    (85 positions x 3 heads) at lr 1e-3, 4 windows of 2,048 tokens, fp32 capture cache. With C = 32
    the paper's ℓ = 32 probes every bucket: pass `nprobe` (e.g. 1-4) with such a model.

Device (`TrainSettings.device`: "auto" [default] = cuda when torch sees a GPU, else cpu; "cpu";
"cuda" or "cuda:N"; `resolve_device`): what runs where is in `training/loop.py`.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from indexer.saap import SaapParams

DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"  # as the service's `device` setting


class TrainSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    clusters: int = Field(1024, ge=2, le=65536, description="C: k-means buckets per layer and KV head")
    kmeans_iters: int = Field(10, ge=1, le=200)
    hidden: int = Field(1024, ge=4, le=16384, description="f_q hidden width")
    steps: int = Field(40000, ge=1, le=10_000_000, description="Adam steps per layer")
    batch: int = Field(1000, ge=2, le=65536, description="queries per step (one window per step; group targets: "
                                                       "batch // G positions x the G heads of each group)")
    lr: float = Field(1e-5, gt=0, le=1.0)
    doc_tokens: int = Field(8192, ge=64, le=1 << 20, description="tokens per training window (capped at the model's positions)")
    n_docs: int = Field(40, ge=1, le=100_000, description="training windows (at most)")
    min_distance: int | None = Field(
        None, ge=1, description="long-range pair distance; None = the decode's dense part (SaapParams.recent_for) "
                                "for a context of one window: min(2047, max(32, doc_tokens // 64))")
    sink_exclude: int = Field(1, ge=0, le=64, description="first tokens left out of k-means and targets (attention sinks)")
    layers: tuple[int, ...] | None = Field(None, description="layers to train (>= 1); None = 1..L-1")
    capture_dtype: Literal["float32", "float16"] = "float16"
    seed: int = Field(0, ge=0, le=2**31 - 1)
    target: Literal["group_mass", "group_density", "query_mass"] = Field(
        "group_mass", description="f_q's training target; `query_mass` is the paper's Eq. 1 (see the module docstring)")
    query_filter: Literal["far_top1", "all"] = Field(
        "far_top1", description="queries f_q trains on: `far_top1` = the paper's long-range queries (top-1 key at "
                                "least min_distance back; for group targets, one of the group's), `all` = every position")
    residual: bool = Field(
        True, description="f_q's logits = centroid similarity q'·c / sqrt(D) + MLP(q') (an untrained f_q is centroid "
                          "probing); False = the paper's plain MLP")
    # Where training computes; not part of the trained model's identity: `exclude=True` keeps it out
    # of model_dump(), so out of the settings hash, the manifest's settings and the REST job id
    # (training/loop.py, "Device").
    device: str = Field("auto", pattern=DEVICE_PATTERN, exclude=True,
                        description="auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N")

    def min_distance_for(self, doc_tokens: int) -> int:
        return self.min_distance if self.min_distance is not None else SaapParams().recent_for(doc_tokens)


PRESETS: dict[str, dict] = {
    "full": {"min_distance": 1024},
    "small": {"clusters": 32, "hidden": 128, "steps": 300, "batch": 256, "lr": 1e-3, "doc_tokens": 2048, "n_docs": 4,
              "capture_dtype": "float32"},
}
PAPER = {"target": "query_mass", "residual": False}  # settings_from(preset, **PAPER): the paper's f_q and Eq. 1


def resolve_device(device: str) -> torch.device:
    """A TrainSettings.device -> the torch device training computes on ("auto": cuda when available;
    "cuda" names the current CUDA device, with its index)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"training device {device!r}: torch sees no CUDA device here (use 'auto' or 'cpu')")
    dev = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev


def settings_from(preset: str, **overrides) -> TrainSettings:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    return TrainSettings(**{**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}})
