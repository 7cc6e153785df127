"""``aionixl bench`` from an installed wheel, outside any checkout.

The wheel is built from a copy of the package (a build in the checkout would write
``build/`` and ``*.egg-info`` there while others work in it), installed with ``--no-deps``
into a folder of its own, and run from a temporary working directory with that folder on
``PYTHONPATH`` and this venv's interpreter (so that its dependencies resolve). About 20 s,
most of it one short bench run: bare NIXL, the threaded model (both from the package's
contenders) and aionixl on asyncio, one repeat each. Marked ``slow``: ``-m "not slow"``
leaves it out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _pip(*args: str, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-index",
                           "--disable-pip-version-check", "--quiet"],
                          capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(the folder the wheel was installed into, a working directory outside the checkout)."""
    tmp = tmp_path_factory.mktemp("aionixl-wheel")
    assert ROOT not in tmp.resolve().parents
    src = tmp / "src"
    for package in ("aionixl", "aionixl_contenders"):
        shutil.copytree(ROOT / package, src / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    dist, site, work = tmp / "dist", tmp / "site", tmp / "work"
    work.mkdir()
    _pip("wheel", "--no-build-isolation", "-w", str(dist), str(src), cwd=work)
    wheels = list(dist.glob("aionixl-*.whl"))
    assert len(wheels) == 1, wheels
    _pip("install", "--target", str(site), str(wheels[0]), cwd=work)
    shutil.rmtree(src)  # nothing of the sources is left beside the installed copy
    yield site, work


def _env(site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(site)
    env.pop("UCX_TLS", None)
    return env


def test_the_wheel_holds_the_contenders(installed: tuple[Path, Path]) -> None:
    site, work = installed
    proc = subprocess.run(
        [sys.executable, "-c", "import aionixl, aionixl_contenders as c; "
         "print(aionixl.__file__); print(c.__file__)"],
        capture_output=True, text=True, timeout=60, env=_env(site), cwd=work)
    assert proc.returncode == 0, proc.stderr
    files = [Path(line) for line in proc.stdout.split()]
    assert len(files) == 2
    for f in files:
        assert site.resolve() in f.resolve().parents, (f, site)
    contenders = site / "aionixl_contenders"
    for name in ("bare_nixl", "threaded", "threaded_connector", "target", "vllm_contender",
                 "vllm_worker", "vllm_decode"):
        assert (contenders / f"{name}.py").is_file(), name


def test_bench_runs_from_the_installed_wheel(installed: tuple[Path, Path]) -> None:
    site, work = installed
    out = work / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "aionixl", "bench", "--quick", "--workload", "micro", "--no-progress",
         "--repeats", "1", "--contenders", "bare,threaded,asyncio", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=_env(site), cwd=work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(out.read_text())
    assert set(report["contenders"]) == {"bare", "threaded", "asyncio"}
    for name, c in report["contenders"].items():
        assert c["ok"] and c["error"] is None, (name, c)
        assert report["info"][name]["verified"] is True, name
    assert report["measures"]["seq_1"]["results"]["bare"]["n"] >= 1
    # Both processes ran the installed copy, the prefill child included.
    for key in ("aionixl_path", "prefill_aionixl_path"):
        path = Path(report["machine"][key])
        assert site.resolve() in path.resolve().parents, (key, path)
