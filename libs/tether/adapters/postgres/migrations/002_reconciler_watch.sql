-- The runs a reconciler watches when it starts to lead: open runs, and finished detached
-- runs whose finish delivery is still owed (a finish hook not yet in the ledger for its
-- status, or a chat notification not yet put out); an aborted run the reconciler gave
-- up on owes nothing. The same predicate as the reconciler's read, `WATCHED`
-- (libs/tether/adapters/postgres/reads.py), so a new leader reads these rows only, not
-- every finished run ever.
CREATE INDEX runs_reconciler_watch ON runs (run_id)
    WHERE status IN ('starting', 'running')
       OR (detached
           AND status IN ('completed', 'error', 'aborted', 'interrupted')
           AND NOT (status = 'aborted' AND coalesce(state->>'aborted_cause', '') = 'give-up')
           AND CASE WHEN state->'detached'->>'on_finish' IS NOT NULL
                    THEN NOT (coalesce(delivery->'finish', '{}'::jsonb)
                              ? (state->'detached'->>'on_finish' || ':' || status))
                    ELSE coalesce(state->'detached'->'notify', 'false'::jsonb)
                             NOT IN ('false'::jsonb, 'null'::jsonb)
                         AND NOT (coalesce(delivery->'notifications', '{}'::jsonb)
                                  ? ('finish:' || status))
               END);
