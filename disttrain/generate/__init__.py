"""Text from a finished run: ``python -m disttrain.generate RUN_DIR --prompt "..."``.

``loading`` loads the run's model and its consolidated weights, ``codec`` turns text into the data's tokens
and back, ``sampling`` extends a prompt token by token.
"""

from __future__ import annotations

from disttrain.generate.codec import ByteCodec, TokenizerCodec, codec_for
from disttrain.generate.loading import LoadedRun, choose_checkpoint, load_run
from disttrain.generate.sampling import next_token, sample

__all__ = [
    "ByteCodec",
    "LoadedRun",
    "TokenizerCodec",
    "choose_checkpoint",
    "codec_for",
    "load_run",
    "next_token",
    "sample",
]
