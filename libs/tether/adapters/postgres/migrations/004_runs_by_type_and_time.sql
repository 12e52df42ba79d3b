-- A parent's runs of one agent type, newest first (the list query with `agent_type`, a
-- page at a time from a cursor; the A2A gateway's ListTasks): read in the list's order
-- (`requested_at DESC, run_id`) from the index and counted on it, however many runs the
-- parent has of other types or before the cursor. `IF NOT EXISTS`: a schema where the
-- index was made by hand takes the migration too.
CREATE INDEX IF NOT EXISTS runs_by_parent_type_requested
    ON runs (parent_agent, parent_name, agent_type, requested_at DESC, run_id);
