"""The README's Python examples run as written (allocator, BlockManager, custom NNX model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


RUNNABLE = [b for b in _blocks() if "CacheConfig" in b]


@pytest.fixture
def no_compile_cache():
    """The examples run eagerly, as a reader would paste them: hundreds of small programs, each
    of which the session's persistent compile cache (on from conftest, every program kept)
    would serialize and write to disk, about 4x their run time. A reader's process has it off
    (only an ``Engine`` turns it on), so the examples run with it off; the session's cache is
    put back after."""
    from paxcache import compile_cache

    before = compile_cache.current_dir()
    compile_cache.disable()
    yield
    if before:
        compile_cache.enable(before)


def test_readme_has_runnable_examples():
    assert len(RUNNABLE) >= 3


@pytest.mark.parametrize("code", RUNNABLE, ids=lambda c: c.split("\n")[0][:40])
def test_readme_example_runs(code, capsys, no_compile_cache):
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})


@pytest.mark.slow
def test_readme_engine_example_runs():
    (code,) = [b for b in _blocks() if "Engine.from_pretrained" in b]
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})
