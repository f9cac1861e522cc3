"""The identity of this package's code, for caches that outlive a process.

``source_hash(folder)`` hashes every Python file under a folder of the package (relative
names and bytes), once per process. Two caches key on it: the persistent autotune picks
(``coalesced_int4/kernels``: a kernel change is a miss) and torch.compile's AOTAutograd
cache through a quantized weight's ``_stable_hash_for_caching`` and pickled state (the whole
package: the dispatch and the kernels are traced into a compiled graph, and the cache key,
taken before the weight's ops are traced, sees neither).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def source_hash(folder: str = "") -> str:
    """Hash of the Python sources under ``folder`` (relative to the package; "" is all of it)."""
    root = PACKAGE / folder
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
