"""Delivering a run's outcome to its parent: the completion hook, the chat notification,
and the delivery ledger's events. The parent service delivers on the fast path, the
reconciler re-delivers what is still owed; both use this package, and neither imports
the other."""
