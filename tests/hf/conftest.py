"""Fixtures of the Hugging Face tests (the models themselves are in hf_models.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hf_models import FAMILIES  # noqa: E402 - after the skip: hf_models needs transformers


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param
