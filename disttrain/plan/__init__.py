"""Plan before training: per-rank memory, communication, pipeline bubble, step time and energy of a layout
(``mode=plan``), and the layout that fits and runs fastest (``parallel=auto``). See ``estimate`` for the
model behind the numbers and ``python -m disttrain.plan --calibrate`` for this machine's profile."""
