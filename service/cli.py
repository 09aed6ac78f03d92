"""`ctxcache` command line: run the service and workers, and talk to a running service."""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import httpx
import typer

app = typer.Typer(help="ctxcache: register long contexts once, ask many questions with sparse decode.",
                  no_args_is_help=True, add_completion=False)

DEFAULT_URL = os.environ.get("CTXCACHE_URL", "http://127.0.0.1:8000")
UrlOpt = typer.Option(DEFAULT_URL, "--url", help="service address (env CTXCACHE_URL)")


def _settings(**overrides):
    from service.settings import Settings

    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def _logging() -> None:
    logging.basicConfig(level=os.environ.get("CTXCACHE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command()
def serve(
    host: Optional[str] = typer.Option(None, help="bind address [127.0.0.1]"),
    port: Optional[int] = typer.Option(None, help="port [8000]"),
    data_dir: Optional[Path] = typer.Option(None, help="artifacts + embedded catalog [./data]"),
    redis_url: Optional[str] = typer.Option(None, help="Redis URL; unset = embedded catalog, workers in this process"),
    model: Optional[str] = typer.Option(None, help="smollm2-135m (default), a .gguf file or an HF model directory"),
    workers: Optional[bool] = typer.Option(None, "--workers/--no-workers", help="run workers in this process [embedded: yes]"),
    storage_url: Optional[str] = typer.Option(None, help="artifacts in object storage: s3://bucket/prefix (env "
                                                         "CTXCACHE_STORAGE_URL) [data dir]"),
):
    """Start the REST API (embedded mode: also the prefill and decode workers)."""
    import uvicorn

    from decoder.model import load_model
    from service.app import create_app

    _logging()
    s = _settings(host=host, port=port, data_dir=data_dir, redis_url=redis_url, model=model, run_workers=workers,
                  storage_url=storage_url)
    typer.echo(f"ctxcache: model {s.model}, data in {s.data_dir.resolve()}, "
               + (f"artifacts in {s.storage_url}, " if s.storage_url else "")
               + f"catalog {'embedded' if s.embedded else s.redis_url} (a GGUF model is converted once on first start)")
    lm = load_model(s.model, s.data_dir, with_weights=False)
    # SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight requests finish for the grace, cancels
    # the rest (their decode requests are cancelled), then the app's shutdown stops the workers and
    # the embedded Redis
    uvicorn.run(create_app(s, lm=lm), host=s.host, port=s.port, log_level="info",
                timeout_graceful_shutdown=s.shutdown_grace_seconds)


def _run_worker(kind: str, redis_url: Optional[str], data_dir: Optional[Path], model: Optional[str],
                metrics_port: Optional[int] = None, storage_url: Optional[str] = None) -> None:
    from service.jobs.decode import DecodeWorker
    from service.jobs.janitor import Janitor
    from service.jobs.prefill import PrefillWorker
    from service.jobs.train import TrainWorker
    from service.metrics import serve_worker_metrics
    from service.runtime import Runtime

    _logging()
    s = _settings(redis_url=redis_url, data_dir=data_dir, model=model, metrics_port=metrics_port,
                  storage_url=storage_url)
    if s.embedded:
        typer.echo("a separate worker needs --redis-url (embedded mode runs workers inside `ctxcache serve`)", err=True)
        raise typer.Exit(2)
    rt = Runtime.create(s)
    rt.ensure_weights()
    worker = {"prefill": PrefillWorker, "decode": DecodeWorker, "train": TrainWorker}[kind](rt)
    loops = [worker, Janitor(rt)]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if s.metrics_port is not None:
        try:
            serve_worker_metrics(rt, loops, s.metrics_port, s.host)
        except OSError as e:  # the port is taken: say so in one line, before any job is claimed
            typer.echo(f"cannot serve metrics on {s.host}:{s.metrics_port}: {e.strerror or e}", err=True)
            rt.close()
            raise typer.Exit(2)
    for lp in loops:
        lp.start()
    typer.echo(f"ctxcache {kind} worker {loops[0].wid} running (model {rt.lm.spec.name})"
               + (f", metrics on http://{s.host}:{s.metrics_port}/metrics" if s.metrics_port else ""))
    stop.wait()
    # drain: no new jobs; a decode worker's held requests may finish for the grace, then are given up
    # (their API retries them on another worker); every loop is joined within the same bound
    end = time.monotonic() + s.shutdown_grace_seconds
    for lp in loops:
        lp.request_stop(s.shutdown_grace_seconds)
    for lp in loops:
        lp.join(end - time.monotonic() + 1.0)
    rt.close()


MetricsPortOpt = typer.Option(None, envvar="CTXCACHE_METRICS_PORT",
                              help="serve Prometheus metrics on this port (bound to CTXCACHE_HOST) [none]")
StorageUrlOpt = typer.Option(None, help="artifacts in object storage: s3://bucket/prefix, the same for every "
                                        "process (env CTXCACHE_STORAGE_URL) [data dir]")


class WorkerKind(str, enum.Enum):
    prefill = "prefill"
    decode = "decode"
    train = "train"


@app.command("worker")
def worker(
    kind: WorkerKind = typer.Argument(..., help="prefill: build contexts (prefill, index, persist); decode: answer "
                                                "questions over stored contexts (GPU if present); train: run offline "
                                                "training jobs (POST /v1/methods/saap/train), sharing the data dir "
                                                "with the prefill workers"),
    redis_url: Optional[str] = typer.Option(None, envvar="CTXCACHE_REDIS_URL"),
    data_dir: Optional[Path] = typer.Option(None),
    model: Optional[str] = typer.Option(None),
    metrics_port: Optional[int] = MetricsPortOpt,
    storage_url: Optional[str] = StorageUrlOpt,
):
    """Run a worker process (distributed mode, with --redis-url): its job loop and a janitor."""
    _run_worker(kind.value, redis_url, data_dir, model, metrics_port, storage_url)


# ---- client commands -------------------------------------------------------------------------


@contextlib.contextmanager
def _client(url: str) -> Iterator[httpx.Client]:
    """An HTTP client for the service; sends `CTXCACHE_API_KEY` as the bearer key when it is set.
    A service that cannot be reached (or drops the connection) ends the command with one line on
    stderr and exit code 1, not a traceback."""
    key = os.environ.get("CTXCACHE_API_KEY", "").strip()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(30.0, read=900.0)) as c:
            yield c
    except httpx.TransportError as e:
        what = "cannot reach" if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) else "lost the connection to"
        reason = " ".join(str(e).split()) or type(e).__name__
        typer.echo(f"error: {what} the ctxcache service at {url} ({reason}); is it running? "
                   f"(--url or CTXCACHE_URL)", err=True)
        raise typer.Exit(1) from None


def _check(resp: httpx.Response) -> dict:
    """The response's JSON, or exit 1 after printing its error (and the field errors in `details`)."""
    if resp.status_code >= 400:
        try:
            err = resp.json()["error"]
            typer.echo(f"error {resp.status_code} {err['code']}: {err['message']}", err=True)
        except (ValueError, KeyError, TypeError):
            typer.echo(f"error {resp.status_code}: {resp.text[:500]}", err=True)
            raise typer.Exit(1)
        for line in _detail_lines(err.get("details")):
            typer.echo(f"  {line}", err=True)
        raise typer.Exit(1)
    return resp.json() if resp.content else {}


def _detail_lines(details) -> list[str]:
    """An error's `details` for a terminal: one `location: message` line per field error (pydantic's
    list of {loc, msg}), else the details as one JSON line."""
    if not details:
        return []
    if isinstance(details, list) and all(isinstance(d, dict) and "msg" in d for d in details):
        return [f"{'.'.join(map(str, d.get('loc') or [])) or '-'}: {d['msg']}" for d in details]
    return [json.dumps(details)]


ID_HEX = frozenset("0123456789abcdef")
MIN_ID_PREFIX = 6


def _resolve_id(c: httpx.Client, given: str) -> str:
    """A context id from a full id or an unambiguous prefix of at least 6 hex digits (matched over
    the service's context list). Exit 2 for an ambiguous or malformed prefix, 1 when none matches."""
    prefix = given.strip().lower()
    if len(prefix) == 64:
        return prefix
    if len(prefix) < MIN_ID_PREFIX or not set(prefix) <= ID_HEX:
        typer.echo(f"error: {given!r} is not a context id: give the 64 hex digits or a unique prefix of at least "
                   f"{MIN_ID_PREFIX}", err=True)
        raise typer.Exit(2)
    matches, offset = [], 0
    while offset is not None:
        page = _check(c.get("/v1/contexts", params={"limit": 200, "offset": offset}))
        matches += [r["id"] for r in page["data"] if r["id"].startswith(prefix)]
        offset = page.get("next_offset")
    if not matches:
        typer.echo(f"error: no context id starts with {prefix}", err=True)
        raise typer.Exit(1)
    if len(matches) > 1:
        typer.echo(f"error: id prefix {prefix} is ambiguous; it matches {len(matches)} contexts: "
                   + ", ".join(sorted(matches)[:10]) + (" ..." if len(matches) > 10 else ""), err=True)
        raise typer.Exit(2)
    return matches[0]


@app.command()
def register(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="UTF-8 text file"),
    method: list[str] = typer.Option([], "--method", "-m", help="method to build an index for (repeatable)"),
    ttl: Optional[int] = typer.Option(None, help="seconds until the context expires"),
    name: Optional[str] = typer.Option(None, help="display name [file name]"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="show progress until ready"),
    url: str = UrlOpt,
):
    """Register a document; prints its id."""
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        typer.echo(f"{file}: not valid UTF-8", err=True)
        raise typer.Exit(1)
    with _client(url) as c:
        body = {"text": text, "methods": method, "display_name": name or file.name}
        if ttl:
            body["ttl_seconds"] = ttl
        rec = _check(c.post("/v1/contexts", json=body))
        cid = rec["id"]
        if wait and rec["status"] not in ("ready", "failed"):
            from tqdm import tqdm

            with tqdm(total=100, desc=f"building {cid[:12]}", unit="%", file=sys.stderr) as bar:
                while rec["status"] not in ("ready", "failed"):
                    time.sleep(0.5)
                    rec = _check(c.get(f"/v1/contexts/{cid}"))
                    bar.set_postfix_str(rec["status"])
                    bar.update(round(100 * rec["progress"]) - bar.n)
        if rec["status"] == "failed":
            typer.echo(f"build failed: {rec.get('error')}", err=True)
            raise typer.Exit(1)
        typer.echo(cid)


@app.command("list")
def list_(url: str = UrlOpt, limit: int = typer.Option(50)):
    """List contexts."""
    with _client(url) as c:
        page = _check(c.get("/v1/contexts", params={"limit": limit}))
    for r in page["data"]:
        typer.echo(f"{r['id']}  {r['status']:<10} {r.get('n_tokens') or '-':>6} tok  "
                   f"{','.join(r['methods']) or '-':<20} {r.get('display_name') or ''}")
    typer.echo(f"({page['total']} total)")


@app.command()
def ask(
    cid: str = typer.Argument(..., metavar="ID"),
    question: str = typer.Argument(...),
    method: str = typer.Option("full", "--method", "-m"),
    param: list[str] = typer.Option([], "--param", "-p", help="method parameter KEY=VALUE (JSON value)"),
    max_tokens: int = typer.Option(128),
    temperature: float = typer.Option(0.0),
    stats: bool = typer.Option(False, help="print usage and decode stats"),
    url: str = UrlOpt,
):
    """Ask a question; the answer streams to stdout. ID: the full id or a unique prefix (>= 6 hex digits)."""
    params = {}
    for p in param:
        k, eq, v = p.partition("=")
        if not eq or not k.strip():
            typer.echo(f"error: --param/-p takes KEY=VALUE (a JSON value, e.g. k=64); got {p!r}", err=True)
            raise typer.Exit(2)
        try:
            params[k.strip()] = json.loads(v)
        except ValueError:
            params[k.strip()] = v
    body = {"question": question, "method": method, "params": params, "max_tokens": max_tokens,
            "temperature": temperature, "stream": True}
    with _client(url) as c, c.stream("POST", f"/v1/contexts/{_resolve_id(c, cid)}/completions", json=body) as resp:
        if resp.status_code >= 400:
            resp.read()
            _check(resp)
        event = None
        for line in resp.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                data = json.loads(line.split(":", 1)[1])
                if event == "token":
                    typer.echo(data["text"], nl=False)
                elif event == "done":
                    typer.echo("")
                    if stats:
                        typer.echo(json.dumps({"usage": data["usage"], "stats": data["stats"]}, indent=1), err=True)
                elif event == "error":
                    typer.echo(f"\nerror {data['error']['code']}: {data['error']['message']}", err=True)
                    raise typer.Exit(1)


@app.command()
def status(cid: str = typer.Argument(..., metavar="ID"), url: str = UrlOpt):
    """Show a context's record. ID: the full id or a unique prefix (>= 6 hex digits)."""
    with _client(url) as c:
        typer.echo(json.dumps(_check(c.get(f"/v1/contexts/{_resolve_id(c, cid)}")), indent=1))


@app.command()
def delete(cid: str = typer.Argument(..., metavar="ID"), url: str = UrlOpt):
    """Delete a context and its artifacts. ID: the full id or a unique prefix (>= 6 hex digits)."""
    with _client(url) as c:
        cid = _resolve_id(c, cid)
        _check(c.delete(f"/v1/contexts/{cid}"))
    typer.echo(f"deleted {cid}")


@app.command()
def fsck(
    url: str = UrlOpt,
    data_dir: Optional[Path] = typer.Option(None, help="verify this data dir directly, without a running service "
                                                       "(reports only; the catalog is not marked)"),
    storage_url: Optional[str] = typer.Option(None, help="verify this bucket (s3://bucket/prefix) directly, without a "
                                                         "running service (reports only, as --data-dir)"),
    mark: bool = typer.Option(True, "--mark/--no-mark", help="set damaged contexts to failed in the catalog"),
):
    """Verify every stored context chunk by chunk (crc32c against its manifest); exit 1 if any is damaged.
    By default through the running service (POST /v1/admin/fsck), which also marks damaged contexts failed
    so that registering them again rebuilds them."""
    if data_dir is not None or storage_url is not None:
        from service.maintenance import verify_store
        from storage.objstore import open_context_store

        s = _settings(data_dir=data_dir, storage_url=storage_url)
        store = open_context_store(storage_url, s.contexts_dir, endpoint_url=s.storage_endpoint_url,
                                   region=s.storage_region)
        report = verify_store(store).to_dict()
    else:
        with _client(url) as c:
            report = _check(c.post("/v1/admin/fsck", params={"mark": str(mark).lower()}))
    for bad in report["damaged"]:
        typer.echo(f"DAMAGED {bad['id']} ({bad['code']}{', marked failed' if bad['marked'] else ''}): "
                   + "; ".join(bad["problems"][:3]))
    typer.echo(f"{report['checked']} contexts checked, {report['ok']} intact, {len(report['damaged'])} damaged")
    if report["damaged"]:
        raise typer.Exit(1)


@app.command("rebuild-catalog")
def rebuild_catalog(url: str = UrlOpt):
    """Re-add every stored context the catalog lost (after Redis lost its data), with its current name and
    expiry, without restarting the service (POST /v1/admin/rebuild-catalog). Deletes nothing."""
    with _client(url) as c:
        out = _check(c.post("/v1/admin/rebuild-catalog"))
    typer.echo(f"re-added {out['added']} contexts ({out['known']} already in the catalog)")



# ---- offline training ------------------------------------------------------------------------

train_app = typer.Typer(help="offline, once per model: train what a sparse method needs (SAAP's classifier)",
                        no_args_is_help=True)
app.add_typer(train_app, name="train")


@train_app.command("saap")
def train_saap(
    model: Optional[str] = typer.Option(None, help="smollm2-135m (default), a .gguf file or an HF model directory"),
    corpus: Optional[Path] = typer.Option(None, help="directory of .txt files [built-in seeded corpus]"),
    out: Optional[Path] = typer.Option(None, help="output directory [<data-dir>/saap/<model fingerprint[:16]>]"),
    data_dir: Optional[Path] = typer.Option(None, help="data directory (model cache, default output) [./data]"),
    preset: Optional[str] = typer.Option(
        None, help="full (the paper's sizes) or small (a few minutes on 2 CPU cores) [full; on a CPU, none: "
                   "refused when the estimate exceeds train_budget_seconds, name a preset]"),
    clusters: Optional[int] = typer.Option(None, help="C, k-means buckets per layer and KV head [full 1024, small 32]"),
    steps: Optional[int] = typer.Option(None, help="Adam steps per layer [full 40000, small 300]"),
    hidden: Optional[int] = typer.Option(None, help="classifier hidden width [full 1024, small 128]"),
    docs: Optional[int] = typer.Option(None, help="training windows [full 40, small 4]"),
    doc_tokens: Optional[int] = typer.Option(None, help="tokens per window [full 8192, small 2048]"),
    layers: Optional[str] = typer.Option(None, help="layers to train, e.g. '1-5' or '1,3,7' [1..L-1]; others run full attention"),
    seed: int = typer.Option(0, help="seed of k-means, initialization and sampling"),
    keep_cache: bool = typer.Option(False, help="keep the captured corpus Q/K after training"),
    threads: Optional[int] = typer.Option(None, help="torch threads [torch's default; 1 was fastest on 2 shared cores]"),
    device: str = typer.Option("auto", help="where to train: auto (cuda when torch sees a GPU, else cpu), cpu, cuda or "
                                            "cuda:N; the model is loaded there for the corpus capture. Not part of the "
                                            "trained model's identity: a GPU run equals a CPU run up to float noise"),
):
    """Train SAAP (key k-means + query classifier) for a model. Resumable: rerun the same command.

    On a GPU (--device auto or cuda): the full preset takes ~0.9 h on one H100 (extrapolated from measured layers).
    On a CPU use --preset small (~3 min on 2 cores); the full preset is ~36 h on 16 cores (benchmarks/RESULTS_saap.md).
    Without --preset on a CPU the command refuses (exit 2) when its estimate (service/limits.py, as for a REST
    training job) exceeds `train_budget_seconds`: the full preset's ~385 h is never started by accident.
    """
    from decoder.model import load_model
    from training.loop import train_saap as _train
    from training.settings import resolve_device, settings_from

    _logging()
    s = _settings(data_dir=data_dir, model=model)
    layer_list = None
    try:
        if layers:
            layer_list = []
            for part in layers.split(","):
                a, _, b = part.strip().partition("-")
                layer_list += list(range(int(a), int(b) + 1)) if b else [int(a)]
        ts = settings_from(preset or "full", clusters=clusters, steps=steps, hidden=hidden, n_docs=docs, doc_tokens=doc_tokens,
                           layers=tuple(layer_list) if layer_list else None, seed=seed, device=device)
        dev = resolve_device(ts.device)
    except ValueError as e:
        typer.echo(f"invalid settings: {e}", err=True)
        raise typer.Exit(2)
    if preset is None and dev.type == "cpu":
        from service.limits import train_cost

        cost = train_cost(load_model(s.model, s.data_dir, with_weights=False).spec, ts)
        if cost.seconds > s.train_budget_seconds:
            typer.echo(f"refused: {cost.what} on a CPU is estimated at ~{cost.seconds / 3600:.1f} h (over "
                       f"train_budget_seconds={s.train_budget_seconds:.0f} s); pass --preset small (minutes), or "
                       f"--preset full to run the full preset anyway", err=True)
            raise typer.Exit(2)
    if threads:
        import torch

        torch.set_num_threads(threads)
    lm = load_model(s.model, s.data_dir, device=str(dev))
    t0 = time.perf_counter()
    path = _train(lm, ts, out_dir=out, data_dir=s.data_dir, corpus_dir=corpus, keep_cache=keep_cache)
    manifest = json.loads((path / "manifest.json").read_text())
    typer.echo(f"saap model for {lm.spec.name} in {path} ({len(manifest['layers'])} layers, C={ts.clusters}, "
               f"digest {manifest['digest'][:16]}, {time.perf_counter() - t0:.0f} s on {dev})")


# ---- evaluation ------------------------------------------------------------------------------


@app.command("eval")
def eval_(
    config: Path = typer.Argument(..., exists=True, dir_okay=False, help="evaluation config (.toml or .json)"),
    out: Path = typer.Option(..., "--out", "-o", help="output directory: results.json, results.md, plots"),
):
    """Compare sparse methods on the same stored artifacts (fidelity, attention recall, RULER-style tasks)."""
    from pydantic import ValidationError

    from evaluation.config import load_config
    from evaluation.harness import run_eval

    _logging()
    try:
        cfg = load_config(config)
    except (ValidationError, ValueError) as e:
        typer.echo(f"invalid config {config}: {e}", err=True)
        raise typer.Exit(2)
    t0 = time.perf_counter()
    results = run_eval(cfg, out)
    typer.echo(f"eval {cfg.name}: {time.perf_counter() - t0:.0f} s; results in {out}/results.json, results.md "
               f"and {len(list(out.glob('*.png')))} plots")


if __name__ == "__main__":
    app()
