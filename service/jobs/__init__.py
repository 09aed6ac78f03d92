"""The work the service does off the request path, and its state in Redis.

* `queue.py`: one leased job queue (enqueue, claim with a lease, heartbeat, finish, lost-worker
  detection), used for prefill builds, decode requests and training jobs.
* `streams.py`: a decode request's token/done/error events and its cancel flag.
* `heartbeats.py`: which workers live, and what each publishes.
* `train_records.py`: offline training jobs' records.
* `base.py`: the worker loops; `prefill.py`, `decode.py`, `train.py`, `janitor.py`: one worker each.
"""
