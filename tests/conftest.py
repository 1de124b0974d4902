"""Shared fixtures. The tests mirror the package (tests/model/ for k2lab/model/, ...); helper modules at this
level (hf_oracle, release_layout, tiny) are importable from every folder because ``pythonpath`` in pyproject.toml
puts tests/ on sys.path.

Markers: ``slow`` marks the long training checks (CI runs them; ``-m "not slow"`` skips them locally)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tiny import TINY, random_model, token_ids

from k2lab import K2Model


@pytest.fixture(scope="module")
def model() -> K2Model:
    """TINY with the oracle's seeded weights (seed 0); one per test module, so no module sees another's edits."""
    return random_model(TINY, seed=0)


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request) -> int:
    """Runs the test at one torch thread and at two (a batched product splits over threads), then restores torch's."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    """[2, 7] token ids for TINY (seed 0)."""
    return token_ids(TINY, batch=2, length=7)


@pytest.fixture
def no_grad():
    """Use with ``pytestmark = pytest.mark.usefixtures("no_grad")`` in modules that never backpropagate."""
    with torch.no_grad():
        yield


@pytest.fixture
def hub_repo(tmp_path, monkeypatch):
    """A stand-in for the Hub, no network: ``hub_repo(folder)`` serves ``folder`` as the remote repo through
    ``hf_hub_download`` (huggingface_hub's, and the name ``k2lab.hub`` imported), which copies each file asked
    for into a snapshot folder holding only what was fetched (as the Hub cache does) and raises EntryNotFoundError for
    a file the repo lacks. Returns the list of file names asked for."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    from k2lab import hub

    def serve(remote: Path) -> list[str]:
        snapshot = tmp_path / "snapshot"
        snapshot.mkdir()
        fetched = []

        def hub_download(repo_id, filename, revision=None, **kwargs):
            fetched.append(filename)
            if not (remote / filename).is_file():
                raise EntryNotFoundError(f"{filename} is not in {repo_id}")
            return str(shutil.copy(remote / filename, snapshot / filename))

        monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub_download)
        monkeypatch.setattr(hub, "hf_hub_download", hub_download)
        return fetched

    return serve
