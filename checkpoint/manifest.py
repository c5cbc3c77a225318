"""The manifest of a packed directory (`moesplit convert`'s output): name, version and reader.

Neutral ground: the shard loads the files (cpu_expert_service.packed); the GPU service's local
stack only needs the shard count, so it reads the manifest here without importing the CPU service.
"""
from __future__ import annotations

import json
import os

MANIFEST = "moesplit-packed.json"
VERSION = 1


class PackedError(ValueError):
    """A packed directory that does not fit the request (other model, shard out of range, incomplete)."""


def read_manifest(packed_dir: str) -> dict:
    path = os.path.join(packed_dir, MANIFEST)
    if not os.path.exists(path):
        raise PackedError(f"{packed_dir}: no {MANIFEST}; point --packed at the --out directory of `moesplit convert`")
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PackedError(f"{path}: unreadable ({e}); re-run `moesplit convert`") from e
    if m.get("moesplit_packed") != VERSION:
        raise PackedError(f"{path}: packed format version {m.get('moesplit_packed')!r}, this moesplit reads "
                          f"{VERSION}; re-run `moesplit convert` with this version")
    return m
