"""Reliability and security: crashes, faults, full disks, load, hostile input, poisoned KV."""
