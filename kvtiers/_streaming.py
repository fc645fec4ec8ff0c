"""Layer-wise loads: chunks delivered wave by wave of layers, each wave reported when final.

An engine computes layer by layer, so the first layers of a loaded prefix are wanted before
the last. A layer-wise load reads tiers that can read some layers only (`Tier.layer_reads`)
in waves of layers: the first wave is one layer, each next one twice the size of the one
before (1, 2, 4, ... layers; see `layer_waves`), so the engine can start on layer 0 after
a small read while the reads of the later, larger waves overlap its compute. Chunks from
the top memory tier and from tiers that read whole chunks arrive with every layer at once.

`LayerStream` wraps the sink of a load, records how many waves each chunk has, and calls
`on_layers(num_layers, num_tokens)` once per wave, in order, when that wave is final: its
layers are in place for the first `num_tokens` tokens and that count will not grow. A wave
is final early when every chunk of the load has it; otherwise when the load ends.
`num_tokens` never grows from one call to the next, and the load's result (the chunks
delivered whole) is at most the last call's count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtiers._endpoints import Sink, View
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.tiers.base import Buffer

if TYPE_CHECKING:
    from kvtiers._movement import Mover

__all__ = ["LayerStream", "OnLayers", "gather_layerwise", "layer_waves", "load_layerwise"]

logger = logging.getLogger("kvtiers")

OnLayers = Callable[[int, int], None]
"""`on_layers(num_layers, num_tokens)`: the first layers of the first tokens are final."""


def layer_waves(num_layers: int) -> tuple[range, ...]:
    """Return the waves of a layer-wise load: 1, 2, 4, ... layers, covering them all.

    A last wave smaller than the one before joins it (32 layers: 1, 2, 4, 8, 17), so no
    wave is a request for a sliver at the end.
    """
    waves, start, size = [], 0, 1
    while start < num_layers:
        end = start + size
        if num_layers - end < size:  # what would be left is smaller: take it now
            end = num_layers
        waves.append(range(start, end))
        start, size = end, size * 2
    return tuple(waves)


class LayerStream(Sink):
    """Deliver through `inner` wave by wave, reporting each wave to `on_layers` when final.

    Args:
        inner: where the chunks go.
        num_layers: the layout's layers.
        num_chunks: the chunks of the load.
        chunk_size: tokens per chunk.
        on_layers: the caller's callback; it runs on the cache's loop and must be quick.
    """

    def __init__(
        self,
        inner: Sink,
        num_layers: int,
        num_chunks: int,
        chunk_size: int,
        on_layers: OnLayers,
    ) -> None:
        self.waves = layer_waves(num_layers)
        self._num_layers = num_layers
        self._inner = inner
        self._chunk_size = chunk_size
        self._on_layers: OnLayers | None = on_layers
        self._have = [0] * num_chunks  # waves delivered, per chunk
        self._reported = 0  # waves reported to on_layers

    def direct(self, idx: int) -> Buffer | None:
        """Return the inner sink's memory for chunk `idx` if a wave can be written alone.

        NOTE: the waves of one chunk are written at once (big chunks in a tier's threads);
        `write_layers` rewrites the whole of any other strided view, which could undo a
        wave written meanwhile, so such a chunk is staged and copied wave by wave instead.
        """
        buf = self._inner.direct(idx)
        if buf is None or buf.flags.c_contiguous:
            return buf
        return buf if buf.ndim > 1 and buf.shape[0] == self._num_layers else None

    async def deliver(self, idxs: list[int], views: Sequence[View]) -> None:
        # docstring inherited
        whole = len(self.waves)
        todo = [(i, v) for i, v in zip(idxs, views, strict=True) if self._have[i] < whole]
        if todo:
            await self._inner.deliver([i for i, _ in todo], [v for _, v in todo])
        for i, _ in todo:
            self._have[i] = whole
        self._advance()

    def delivered(self, idxs: list[int]) -> None:
        """Record that chunks `idxs` were read whole into the sink's own memory."""
        for i in idxs:
            self._have[i] = len(self.waves)
        self._advance()

    async def deliver_wave(
        self, wave: int, idxs: list[int], views: Sequence[View], *, in_place: bool = False
    ) -> None:
        """Deliver wave `wave`'s layers of chunk `idxs[j]` from `views[j]`.

        `in_place`: the views are the sink's own memory (`direct`), so nothing is copied.
        """
        if idxs and not in_place:
            await self._inner.deliver_layers(idxs, views, self.waves[wave])
        for i in idxs:
            self._have[i] = max(self._have[i], wave + 1)
        self._advance()

    def finish(self, loaded: int) -> None:
        """Report the waves not yet final, now that the load delivered `loaded` chunks."""
        for wave in range(self._reported, len(self.waves)):
            run = next((i for i, have in enumerate(self._have) if have <= wave), len(self._have))
            self._report(wave, min(run, loaded))

    def _advance(self) -> None:
        while self._reported < len(self.waves) and all(h > self._reported for h in self._have):
            self._report(self._reported, len(self._have))

    def _report(self, wave: int, num_chunks: int) -> None:
        self._reported = wave + 1
        if self._on_layers is None:
            return
        try:
            self._on_layers(self.waves[wave].stop, num_chunks * self._chunk_size)
        except Exception:
            # NOTE: the caller's bug must not fail the load (it holds pins and promotions);
            # it is logged once and the callback is not called again.
            logger.exception("kvtiers: on_layers raised; not called again for this load")
            self._on_layers = None


async def load_layerwise(
    mover: Mover, keys: Sequence[ChunkKey], sink: Sink, layout: KVLayout, on_layers: OnLayers
) -> int:
    """Load the cached prefix of `keys` into `sink` wave by wave; return the chunks loaded.

    The prefix is found first (`Mover.longest_prefix`), so waves are final as soon as every
    chunk of it has them, not only when the load ends.
    """
    num = await mover.longest_prefix(keys) if keys else 0
    stream = LayerStream(sink, layout.num_layers, num, layout.chunk_size, on_layers)
    loaded = await mover.load(keys[:num], stream) if num else 0
    stream.finish(loaded)
    return loaded


async def gather_layerwise(
    mover: Mover, keys: Sequence[ChunkKey], sink: Sink, layout: KVLayout, on_layers: OnLayers
) -> list[bool]:
    """Deliver each chunk of `keys` some tier holds into `sink` wave by wave (`Mover.gather`).

    A wave is final early only when every key has it; a key no tier holds holds it back
    until the end, so pass the keys expected to hit.
    """
    stream = LayerStream(sink, layout.num_layers, len(keys), layout.chunk_size, on_layers)
    found = await mover.gather(keys, stream)
    stream.finish(next((i for i, hit in enumerate(found) if not hit), len(found)))
    return found
