"""Fixtures of the reliability suite: the loopback S3 server of the tier tests."""

from __future__ import annotations

from tests.tiers.conftest import moto_s3

__all__ = ["moto_s3"]
