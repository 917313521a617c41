"""Fixtures of the evaluation jobs' tests: the tiny model is tests/conftest.py's ``tiny_model_dir``."""

import pytest

pytest.importorskip("transformers")
