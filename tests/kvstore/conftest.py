"""Small shared fixtures for the kvstore tests.

Every test draws its own inputs from ``gen``: a torch generator seeded from the test's node id, so
inputs are fresh per test (and per parameter) yet identical from run to run. Setting the environment
variable PLANEKV_TEST_SALT draws a different (still deterministic) set of inputs.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from planekv.kvstore import Calibration, Codec, FormatSpec
from planekv.kvstore.synthetic import make_synthetic


@pytest.fixture(autouse=True)
def _one_thread():
    """The tensors here are tiny: one intra-op thread is faster, and immune to a busy machine
    (OpenMP threads spinning against other processes can make a test 10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _seed(request: pytest.FixtureRequest) -> int:
    # PLANEKV_TEST_SALT (unset by default) draws another, equally deterministic, set of inputs.
    return zlib.crc32((os.environ.get("PLANEKV_TEST_SALT", "") + request.node.nodeid).encode())


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(request))


@pytest.fixture
def unit_codec():
    """Factory: a Codec whose calibration is mu = 0, sigma = 1 (or the given tensors), so z is the
    transformed value itself."""

    def make(n_layers: int = 1, n_q_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 64, width: int = 8,
             page_size: int = 64, mu: torch.Tensor | None = None, sigma: torch.Tensor | None = None,
             model_id: str = "unit") -> Codec:
        shape = (n_layers, n_kv_heads, head_dim)
        mu = torch.zeros(shape) if mu is None else mu
        sigma = torch.ones(shape) if sigma is None else sigma
        spec0 = FormatSpec(model_id=model_id, n_layers=n_layers, n_q_heads=n_q_heads, n_kv_heads=n_kv_heads,
                           head_dim=head_dim, calibration_id="-", width=width, page_size=page_size)
        calib = Calibration(mu, sigma, mu.clone(), sigma.clone(), spec0.seed_k, spec0.seed_v)
        spec = FormatSpec(**{**spec0.to_dict(), "calibration_id": calib.calibration_id})
        return Codec(spec, calib)

    return make


@pytest.fixture
def synthetic(request: pytest.FixtureRequest):
    """Factory: (SyntheticKV, Codec) from planekv.kvstore.synthetic.make_synthetic; the seed defaults to
    one derived from the test's node id."""

    def make(**kw):
        kw.setdefault("seed", _seed(request) % 2**31)
        syn = make_synthetic(**kw)
        return syn, Codec(syn.spec, syn.calibration)

    return make
