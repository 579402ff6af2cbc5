"""Imported first by the fork server: the garbage collector stays off while the server imports torch and Lightning,
whose modules it would otherwise walk again at every full collection; ``frozen_heap``, imported last, collects once,
freezes what is alive and turns it back on."""

import gc

gc.disable()
