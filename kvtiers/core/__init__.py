"""The pure core: layout, keys, prefix index, block pool, config and its checks, stats, errors.

Nothing here does I/O or imports torch.
"""
