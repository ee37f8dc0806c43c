"""The services' start-up heap, kept out of the garbage collector's way.

Start-up leaves each service ~300,000 long-lived objects that Python's cyclic collector tracks
(torch, transformers, the model or the tokenizer). A full collection walks all of them: ~210-235
ms on the Zen 5 of bench/RESULTS.md. Python 3.11 spent 0.68 s (executor) and 0.73 s (scheduler)
in collections while they started, five of them full; and while serving, a full collection at an
unlucky moment would stall every stream for as long.

So a service's `main` pauses collection before it imports torch (`pause_collection`), and once
it is ready to serve, collects what start-up left as garbage and freezes the survivors
(`freeze_startup_heap`): `gc.freeze` moves them to a permanent generation that no later
collection walks (a full collection then takes microseconds), and collection resumes. Start-up
then spends ~0.28 s in that one collection, and a warm executor start went from 3.02 to 2.71 s
(bench/startup_ab.py). vLLM freezes its start-up heap the same way (vllm/utils/gc_utils.py).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("chunkwise")


def pause_collection() -> None:
    """No automatic collection until `freeze_startup_heap` (call it first thing in `main`)."""
    gc.disable()


def freeze_startup_heap(service: str) -> int:
    """Collect start-up's garbage, freeze what survives, resume automatic collection; the number
    of objects frozen."""
    gc.collect()
    gc.freeze()
    gc.enable()
    frozen = gc.get_freeze_count()
    log.info("%s start-up heap: %d objects frozen, out of the collector's way while serving", service, frozen)
    return frozen
