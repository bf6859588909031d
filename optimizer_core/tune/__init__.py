"""Automatic search of variant settings under a time budget (``graphtrim tune``).

:mod:`graphtrim.tune.space` declares the knobs per variant kind, :mod:`graphtrim.tune.search`
runs the search, :mod:`graphtrim.tune.memory` keeps the winners per graph signature and
device, :mod:`graphtrim.tune.report` writes what happened.
"""
