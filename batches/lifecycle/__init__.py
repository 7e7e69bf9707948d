"""The one home of batch and item state, in rooms that depend on each other one way, bottom up:

    states.py   the transition tables, the named groups, move, lock, due
    sql.py      prepared statements and rows without model instances (the hot path's SQL)
    stop.py     completion, cancel and expiry per surface
    finish.py   an item's final write, release, rescue, the finish held for the next claim
    claim.py    the fair claim

Import the module you need (`from batches.lifecycle import claim`); this package exports nothing.
"""
