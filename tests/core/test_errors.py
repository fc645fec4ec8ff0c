"""Tests of the exception tree in `kvtiers.core.errors`."""

from __future__ import annotations

import pytest

from kvtiers.core import errors
from kvtiers.core.errors import (
    CacheStateError,
    ConfigError,
    InvalidInputError,
    KVTiersError,
    LayoutMismatch,
    TierError,
    TierFullError,
    TierIOError,
    TokenError,
)


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_derives_from_kvtiers_error(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, KVTiersError)
    assert issubclass(cls, Exception)


@pytest.mark.parametrize(
    "cls", [ConfigError, InvalidInputError, TokenError, LayoutMismatch], ids=lambda c: c.__name__
)
def test_bad_input_errors_are_value_errors(cls: type[Exception]) -> None:
    assert issubclass(cls, ValueError)
    with pytest.raises(ValueError):
        raise cls("bad")


@pytest.mark.parametrize(
    ("cls", "parent"),
    [
        (TokenError, InvalidInputError),
        (LayoutMismatch, InvalidInputError),
        (TierIOError, TierError),
        (TierFullError, TierError),
        (TierIOError, OSError),
        (CacheStateError, RuntimeError),
    ],
    ids=lambda c: c.__name__,
)
def test_tree_shape(cls: type[Exception], parent: type[Exception]) -> None:
    assert issubclass(cls, parent)


@pytest.mark.parametrize(
    "cls", [TierError, TierFullError, TierIOError, CacheStateError], ids=lambda c: c.__name__
)
def test_state_and_tier_errors_are_not_value_errors(cls: type[Exception]) -> None:
    assert not issubclass(cls, ValueError)


def test_all_lists_every_error_class() -> None:
    defined = {
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, BaseException)
    }
    assert set(errors.__all__) == defined
    assert errors.__all__ == sorted(errors.__all__)


def test_message_is_kept() -> None:
    exc = ConfigError("tiers[0].capacity: must be greater than zero")
    assert str(exc) == "tiers[0].capacity: must be greater than zero"
