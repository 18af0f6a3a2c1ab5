"""Imported last by the fork server: its heap (torch, Dask, pandas: millions of objects) is
moved out of the garbage collector's reach before any worker is forked from it.

Without it, a forked worker's first full collection walks every inherited object, and writing
their GC headers copies each page the fork shared: measured here, a quarter of a second of a
replacement worker's start, spent before it can rejoin. ``gc.freeze`` is the fork servers'
usual answer (CPython documents it for this); a worker collects its own objects as before, and
freezes what its jobs import in turn (``workers/between_jobs.py``).
"""

import gc

gc.freeze()
