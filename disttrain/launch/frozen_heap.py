"""Imported last by the fork server, after torch and Lightning: moves every object alive there out of the garbage
collector's reach (``gc.freeze``), so that a forked rank's collections never walk, and so never write to and copy,
the memory it shares with the server; then turns the collector back on (``gc_paused`` turned it off for the
imports), for the server and every rank it forks."""

import gc

gc.collect()
gc.freeze()
gc.enable()
