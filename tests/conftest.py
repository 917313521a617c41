"""Suite-wide: without a GPU, Triton kernels run in Triton's interpreter (the variable must be set before any
test module imports planekv.kernels: triton.jit reads it at decoration time); tests marked ``slow`` are
collected first, so that with one worker per core (``make test``) the long ones start early and the workers
finish together."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow first, order kept
