"""Real engines, peers in child processes and fault injection for your own test suites.

Everything here runs real NIXL agents and real transfers; nothing is faked.

- :func:`make_caches` builds KV-cache regions whose every block is a deterministic function
  of ``(seed, region, block)``, so a test can recompute what any block must hold, and
  :func:`assert_blocks_equal` checks blocks read against that rule.
- :class:`RemoteEngine` runs an :class:`aionixl.Engine` in a child process that a test can
  pause (SIGSTOP), resume, kill (SIGKILL) and restart on the same address with new content.
  Its graceful stop is checked: a child that exits non-zero or whose engine still holds NIXL
  resources after closing raises :class:`RemoteEngineStopError`.
- :func:`engine_pair` gives two connected engines in this process.
- :class:`TwoHosts` gives two network namespaces joined by a veth pair whose link a test
  can cut (root only); :class:`FleetHosts` several on one bridge, with a real etcd
  (:class:`Etcd`) that their engines register in, links that can be cut one host at a time,
  and :meth:`FleetHosts.remote_engine` to start engines there.
- As a pytest plugin (``pytest_plugins = ["aionixl.testing"]`` or ``-p aionixl.testing``)
  it adds the fixtures ``aionixl_remote`` and ``aionixl_pair``; they work under anyio's
  pytest plugin (asyncio and trio) and under pytest-asyncio. Importing this package
  imports neither pytest nor torch (torch comes with the first cache or dtype check).

The modules form layers, each importing only the ones before it (this package's
``__init__`` sits on top and imports them; none of them imports the package itself):

1. ``_caches``: deterministic caches, ``assert_blocks_equal``, ``assert_no_resources``;
   ``_etcd``: :class:`Etcd`;
2. ``_child``: the child process's main (aionixl's public API, :mod:`aionixl._lines`,
   ``_caches``);
3. ``_remote``: :class:`RemoteEngine`, the parent side (``_caches``, ``_child``);
4. ``_pair``: :func:`engine_pair` (``_caches``); ``_hosts``: :class:`TwoHosts` and
   :class:`FleetHosts` (``_remote``, ``_etcd``);
5. ``_plugin``: the pytest fixtures (``_pair``, ``_remote``, pytest). Only pytest imports
   it, because :data:`pytest_plugins` below names it: pytest loads the plugins a plugin
   module lists, so registering needs no hook and no import back up.

PYTEST_DONT_REWRITE: the assertions here raise AssertionError with their own messages.
"""

from ._caches import (
    DEFAULT_BLOCK_SHAPE,
    DEFAULT_DTYPES,
    DEFAULT_NUM_BLOCKS,
    assert_blocks_equal,
    assert_no_resources,
    block_bytes,
    make_caches,
    unique_name,
)
from ._etcd import Etcd, EtcdError
from ._hosts import FleetHosts, Host, TwoHosts, TwoHostsError
from ._pair import Pair, engine_pair
from ._remote import RemoteEngine, RemoteEngineError, RemoteEngineStopError

__all__ = [
    "DEFAULT_BLOCK_SHAPE",
    "DEFAULT_DTYPES",
    "DEFAULT_NUM_BLOCKS",
    "Etcd",
    "EtcdError",
    "FleetHosts",
    "Pair",
    "RemoteEngine",
    "RemoteEngineError",
    "RemoteEngineStopError",
    "TwoHosts",
    "TwoHostsError",
    "Host",
    "assert_blocks_equal",
    "assert_no_resources",
    "block_bytes",
    "engine_pair",
    "make_caches",
    "unique_name",
]

#: When pytest loads this package as a plugin it loads these too: the fixtures.
pytest_plugins = ["aionixl.testing._plugin"]
