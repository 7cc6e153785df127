"""Where an engine runs, and which read mode a pair of engines uses.

Told to peers in the handshake (``host``), so that each side can decide whether a
one-sided GET is native between them (shared memory on one node, or RDMA on both) or
whether reads should be pushed by the serving engine (UCX over TCP; see
:mod:`aionixl._push` for why).
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping
from typing import Literal

from ._wire import PUSH_FEATURE

ReadMode = Literal["get", "push"]


_SHM_TLS = {"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem"}
_RDMA_TLS = {"ib", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5",
             "ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5"}


def _tls_allows(tls: str, family: set[str], whole: set[str]) -> bool:
    """Whether a ``UCX_TLS`` value lets UCX use a transport of ``family``.

    Unset or ``all``: yes. A list: yes if it names one of them. An exclusion list (``^``):
    yes unless it excludes the family by its alias (``whole``) or every member.
    """
    text = tls.strip().lower()
    if not text or text == "all":
        return True
    negated = text.startswith("^")
    items = {t.strip() for t in text.lstrip("^").split(",") if t.strip()}
    if negated:
        return not (items & whole) and not family <= items
    return bool(items & family)


def shm_allowed(tls: str) -> bool:
    return _tls_allows(tls, _SHM_TLS, {"sm", "shm"})


def rdma_allowed(tls: str) -> bool:
    return _tls_allows(tls, _RDMA_TLS, {"ib"})


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def host_facts() -> dict[str, str]:
    """What this engine tells its peers about where it runs (handshake ``host``).

    ``node``: a digest of the boot id, the host name and the IPC, PID, user and mount
    namespaces: two engines with the same one can use shared memory (what UCX checks
    before using its shared-memory transports). ``ucx_tls``: this process's ``UCX_TLS``.
    ``rdma``: "1" when an RDMA device is present and UCX_TLS allows an RDMA transport.
    """
    digest = hashlib.sha256(b"aionixl-node-v1")
    digest.update(_read("/proc/sys/kernel/random/boot_id").encode())
    digest.update(socket.gethostname().encode())
    for ns in ("ipc", "pid", "user", "mnt"):
        try:
            digest.update(os.readlink(f"/proc/self/ns/{ns}").encode())
        except OSError:
            digest.update(b"?")
    tls = os.environ.get("UCX_TLS", "")
    try:
        rdma_devices = bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        rdma_devices = False
    return {"node": digest.hexdigest()[:32], "ucx_tls": tls[:200],
            "rdma": "1" if rdma_devices and rdma_allowed(tls) else "0"}


def choose_read_mode(setting: str, features: frozenset[str], ours: Mapping[str, str],
                     theirs: Mapping[str, str]) -> ReadMode:
    """GET where the path between the two engines is native, push otherwise.

    Native: the same node with shared memory allowed by both sides' ``UCX_TLS``, or RDMA
    on both. A peer without the push feature (an older engine) always gets GET; so does
    everyone under ``read_mode="get"``, and ``"push"`` forces push where the peer can.
    """
    if PUSH_FEATURE not in features or setting == "get":
        return "get"
    if setting == "push":
        return "push"
    node = ours.get("node")
    if node and node == theirs.get("node") and shm_allowed(ours.get("ucx_tls", "")) \
            and shm_allowed(theirs.get("ucx_tls", "")):
        return "get"
    if ours.get("rdma") == "1" and theirs.get("rdma") == "1":
        return "get"
    return "push"
