"""The event stream of a decode request, in Redis: how a decode worker's tokens reach the API.

    {p}out:{rid}     stream of request rid's events: `token` ({"text", "token_id"}), then one `done`
                     (the answer) or `error` ({"code", "message"}); expires 10 minutes after the last
    {p}cancel:{rid}  set when the request's client went away; the worker stops at its next step

The worker writes (`emit`) and checks `cancelled`; the API reads with its asyncio client
(`service/api/decode_client.py`), through the same key names and `stream_events`.
"""

from __future__ import annotations

import json

import redis

CANCEL_TTL_S = 600  # how long a cancel flag stays (a request is answered or gone well before)


def stream_events(got) -> list[tuple[str, str, dict]]:
    """A request's stream entries, as XREAD returns them (sync or asyncio client), ->
    [(entry id, event, data)]."""
    out = []
    for _, entries in got or []:
        for eid, fields in entries:
            f = {k.decode(): v.decode() for k, v in fields.items()}
            out.append((eid.decode(), f["event"], json.loads(f["data"])))
    return out


class DecodeStreams:
    def __init__(self, client: redis.Redis, prefix: str):
        self.r = client
        self.p = prefix

    def k_out(self, rid: str) -> str:
        return f"{self.p}out:{rid}"

    def k_cancel(self, rid: str) -> str:
        return f"{self.p}cancel:{rid}"

    def emit(self, rid: str, event: str, data: dict, ttl_s: int = 600) -> None:
        key = self.k_out(rid)
        with self.r.pipeline() as pipe:
            pipe.xadd(key, {"event": event, "data": json.dumps(data)})
            pipe.expire(key, ttl_s)
            pipe.execute()

    def events(self, rid: str, last_id: str, block_ms: int) -> list[tuple[str, str, dict]]:
        return stream_events(self.r.xread({self.k_out(rid): last_id}, block=block_ms))

    def cancel(self, rid: str) -> None:
        self.r.set(self.k_cancel(rid), "1", ex=CANCEL_TTL_S)

    def cancelled(self, rid: str) -> bool:
        return bool(self.r.exists(self.k_cancel(rid)))
