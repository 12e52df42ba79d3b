-- Projections of the run-events log. Every row is derived from events only (no now(),
-- no sequences), so a rebuild from stream sequence 1 yields identical tables.

CREATE TABLE runs (
    parent_agent        text    NOT NULL,
    parent_name         text    NOT NULL,
    run_id              text    NOT NULL,
    agent_type          text    NOT NULL,
    status              text    NOT NULL,
    detached            boolean NOT NULL,
    input_preview       text    NOT NULL,
    parent_tool_call_id text,
    display_order       integer,
    display             text,
    summary             text,
    output              jsonb,
    error               text,
    reason              text,
    child_still_running boolean,
    progress            jsonb,
    last_signal_at      bigint,
    requested_at        bigint  NOT NULL,
    started_at          bigint,
    ended_at            bigint,
    max_budget_deadline  bigint,
    no_progress_deadline bigint,
    cancel_requested_at bigint,
    attempt             integer NOT NULL,
    milestone_count     integer NOT NULL,
    output_chunks       integer NOT NULL,
    step_count          integer NOT NULL,
    delivery            jsonb   NOT NULL,
    events_applied      integer NOT NULL,
    last_seq            bigint  NOT NULL,
    state               jsonb   NOT NULL,
    PRIMARY KEY (parent_agent, parent_name, run_id)
);

CREATE INDEX runs_by_parent_status ON runs (parent_agent, parent_name, status);
CREATE INDEX runs_by_tool_call ON runs (parent_agent, parent_name, parent_tool_call_id);
-- The reconciler's deadline index: only open or interrupted runs have live deadlines.
CREATE INDEX runs_max_budget_due ON runs (max_budget_deadline)
    WHERE max_budget_deadline IS NOT NULL AND status IN ('starting', 'running');
CREATE INDEX runs_no_progress_due ON runs (no_progress_deadline)
    WHERE no_progress_deadline IS NOT NULL AND status IN ('starting', 'running');

CREATE TABLE milestones (
    parent_agent text    NOT NULL,
    parent_name  text    NOT NULL,
    run_id       text    NOT NULL,
    sequence     integer NOT NULL,
    name         text    NOT NULL,
    data         jsonb,
    occurred_at  bigint  NOT NULL,
    PRIMARY KEY (parent_agent, parent_name, run_id, sequence)
);

CREATE TABLE reattach_decisions (
    parent_agent        text    NOT NULL,
    parent_name         text    NOT NULL,
    run_id              text    NOT NULL,
    decision_id         text    NOT NULL,
    outcome             text    NOT NULL,
    reason              text,
    child_still_running boolean NOT NULL,
    timings             jsonb   NOT NULL,
    decided_at          bigint  NOT NULL,
    PRIMARY KEY (parent_agent, parent_name, run_id, decision_id)
);

-- Messages of the log that could not be projected, with why; the projector goes on.
CREATE TABLE dead_letters (
    stream_seq bigint PRIMARY KEY,
    subject    text   NOT NULL,
    error_kind text   NOT NULL,
    error      text   NOT NULL,
    payload    bytea  NOT NULL
);

CREATE TABLE checkpoints (
    projection text   PRIMARY KEY,
    last_seq   bigint NOT NULL
);
