"""Conformance test suites that policy and tier implementations subclass."""
