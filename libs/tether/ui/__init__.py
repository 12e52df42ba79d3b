"""`tether ui`: a live web timeline of parents, their runs and the runs' children.

What is stored comes from the Postgres projections; what is happening comes from the
events stream, followed from the projection's checkpoint and pushed to the page by
server-sent events, coalesced per run. Actions (cancel, re-request, clear, continue) are
the client's commands, sent with the UI's own NATS user: under an application user the
UI shows and acts only for that application's parents (`tether.ui.gate`).
"""
