"""Offline training of per-model components of sparse methods: today SAAP's key k-means + query
classifier (`ctxcache train saap`, `POST /v1/methods/saap/train`). Above `decoder/` (it prefills
its corpus through the model), below `service/`; the trained-model format and the method that
reads it live in `indexer/saap.py`.

  settings.py     TrainSettings, presets, device choice (what a run is asked to do)
  corpus.py       the built-in seeded corpus; reading / writing a corpus directory
  capture.py      corpus -> token windows -> first layers' Q/K, cached on disk
  checkpoints.py  atomic safetensors writes and their metadata (what makes a run resumable)
  classifier.py   the query classifier f_q (StackedMLP) and its long-range targets
  loop.py         train_saap: per layer k-means (indexer/clustering.py) + f_q, checkpoints, manifest
  bucket_mass.py  held-out check of a trained layer: classifier vs centroid probing
"""
