"""The pure core: layout, keys, prefix index, block pool, config, stats, errors.

Nothing here does I/O or imports torch.
"""
