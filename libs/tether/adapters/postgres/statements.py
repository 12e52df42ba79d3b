"""The SQL of the projection tables, qualified by schema so a swapped-in schema is
picked up, and the `runs` table's columns."""

from dataclasses import dataclass

from tether.adapters.postgres.migrator import check_schema_name

DIGEST_TABLES: dict[str, str] = {
    "runs": "parent_agent, parent_name, run_id",
    "milestones": "parent_agent, parent_name, run_id, sequence",
    "reattach_decisions": "parent_agent, parent_name, run_id, decision_id",
    "dead_letters": "stream_seq",
}


@dataclass(frozen=True)
class Statements:
    """The SQL of one projection schema, qualified so a swapped-in schema is picked up."""

    schema: str

    def __post_init__(self) -> None:
        check_schema_name(self.schema)

    def _q(self, sql: str) -> str:
        return sql.replace("{s}", f'"{self.schema}"')

    @property
    def lock_checkpoint(self) -> str:
        """Create the checkpoint if need be and lock it, in one statement."""
        return self._q("INSERT INTO {s}.checkpoints (projection, last_seq) VALUES ($1, 0) "
                       "ON CONFLICT (projection) DO UPDATE SET last_seq = {s}.checkpoints.last_seq "
                       "RETURNING last_seq")

    @property
    def create_checkpoint(self) -> str:
        return self._q("INSERT INTO {s}.checkpoints (projection, last_seq) VALUES ($1, 0) "
                       "ON CONFLICT (projection) DO NOTHING")

    @property
    def read_checkpoint(self) -> str:
        return self._q("SELECT last_seq FROM {s}.checkpoints WHERE projection = $1")

    @property
    def take_lease_term(self) -> str:
        """The next term of a lease, for its new holder: the fencing token its writes carry."""
        return self._q("INSERT INTO {s}.leases (name, term) VALUES ($1, 1) "
                       "ON CONFLICT (name) DO UPDATE SET term = {s}.leases.term + 1 "
                       "RETURNING term")

    @property
    def lease_term_for_share(self) -> str:
        """A lease's current term, locked until the transaction ends: a new holder's
        `take_lease_term` waits for a batch that read it, and a batch that reads it after
        sees the new term."""
        return self._q("SELECT term FROM {s}.leases WHERE name = $1 FOR SHARE")

    @property
    def any_rows(self) -> str:
        return self._q("SELECT EXISTS (SELECT FROM {s}.runs) OR EXISTS (SELECT FROM {s}.milestones) "
                       "OR EXISTS (SELECT FROM {s}.reattach_decisions) "
                       "OR EXISTS (SELECT FROM {s}.dead_letters)")

    @property
    def runs_estimate(self) -> str:
        """The planner's row count of `runs` (-1: never analyzed)."""
        return self._q("SELECT reltuples::bigint FROM pg_class WHERE oid = '{s}.runs'::regclass")

    @property
    def analyze_runs(self) -> str:
        """Statistics of the columns lookups and lists filter on, only: the other columns
        are the large documents, which no query filters on."""
        return self._q("ANALYZE {s}.runs (parent_agent, parent_name, run_id, status, "
                       "parent_tool_call_id, requested_at, max_budget_deadline, "
                       "no_progress_deadline)")

    @property
    def advance_checkpoint(self) -> str:
        return self._q("UPDATE {s}.checkpoints SET last_seq = $2 WHERE projection = $1")

    @property
    def load_states(self) -> str:
        # A join, not a lookup per key: without statistics (a fresh table) the planner
        # may take another (agent, name, ...) index for a per-key lookup and scan all of
        # a parent's runs for each key.
        return self._q("""
            SELECT r.parent_agent, r.parent_name, r.run_id, r.state::text AS state
            FROM {s}.runs r
            JOIN unnest($1::text[], $2::text[], $3::text[]) AS k(a, n, id)
              ON r.parent_agent = k.a AND r.parent_name = k.n AND r.run_id = k.id
        """)

    @property
    def upsert_runs(self) -> str:
        """Each row is sent as its state document, its stream sequence and its input
        preview; every other column is read off the document here
        (`RUN_COLUMNS_FROM_STATE`), so the projector serialises a run once per write."""
        columns = ", ".join(RUN_COLUMNS)
        values = ", ".join(RUN_COLUMNS_FROM_STATE.get(c, f"x.{c}") for c in RUN_COLUMNS)
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in RUN_COLUMNS[3:])
        return self._q(f"""
            INSERT INTO {{s}}.runs ({columns})
            SELECT {values}
            FROM jsonb_to_recordset($1::jsonb) AS x(input_preview text, last_seq bigint,
                                                    state jsonb)
            ON CONFLICT (parent_agent, parent_name, run_id) DO UPDATE SET {updates}
        """)

    @property
    def delete_runs(self) -> str:
        return self._q(_DELETE_BY_KEYS.format(table="{s}.runs"))

    @property
    def delete_milestones(self) -> str:
        return self._q(_DELETE_BY_KEYS.format(table="{s}.milestones"))

    @property
    def delete_decisions(self) -> str:
        return self._q(_DELETE_BY_KEYS.format(table="{s}.reattach_decisions"))

    @property
    def insert_milestones(self) -> str:
        return self._q("""
            INSERT INTO {s}.milestones
                (parent_agent, parent_name, run_id, sequence, name, data, occurred_at)
            SELECT * FROM jsonb_to_recordset($1::jsonb) AS x(parent_agent text,
                parent_name text, run_id text, sequence integer, name text, data jsonb,
                occurred_at bigint)
            ON CONFLICT DO NOTHING
        """)

    @property
    def insert_decisions(self) -> str:
        return self._q("""
            INSERT INTO {s}.reattach_decisions (parent_agent, parent_name, run_id,
                decision_id, outcome, reason, child_still_running, timings, decided_at)
            SELECT * FROM jsonb_to_recordset($1::jsonb) AS x(parent_agent text,
                parent_name text, run_id text, decision_id text, outcome text, reason text,
                child_still_running boolean, timings jsonb, decided_at bigint)
            ON CONFLICT DO NOTHING
        """)

    @property
    def insert_dead_letters(self) -> str:
        return self._q("""
            INSERT INTO {s}.dead_letters (stream_seq, subject, error_kind, error, payload)
            SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::bytea[])
            ON CONFLICT DO NOTHING
        """)

    def digest(self, table: str) -> str:
        order = DIGEST_TABLES[table]
        return self._q(f"SELECT count(*) AS rows, coalesce(md5(string_agg(t::text, E'\\n' "
                       f"ORDER BY {order})), md5('')) AS digest FROM {{s}}.{table} t")


_DELETE_BY_KEYS = """
    DELETE FROM {table} t
    USING unnest($1::text[], $2::text[], $3::text[]) AS k(a, n, id)
    WHERE t.parent_agent = k.a AND t.parent_name = k.n AND t.run_id = k.id
"""

RUN_COLUMN_DEFINITIONS: tuple[tuple[str, str], ...] = (
    ("parent_agent", "text"), ("parent_name", "text"), ("run_id", "text"),
    ("agent_type", "text"), ("status", "text"), ("detached", "boolean"),
    ("input_preview", "text"), ("parent_tool_call_id", "text"), ("display_order", "integer"),
    ("display", "text"), ("summary", "text"), ("output", "jsonb"), ("error", "text"),
    ("reason", "text"), ("child_still_running", "boolean"), ("progress", "jsonb"),
    ("last_signal_at", "bigint"), ("requested_at", "bigint"), ("started_at", "bigint"),
    ("ended_at", "bigint"), ("max_budget_deadline", "bigint"),
    ("no_progress_deadline", "bigint"), ("cancel_requested_at", "bigint"),
    ("attempt", "integer"), ("milestone_count", "integer"), ("output_chunks", "integer"),
    ("step_count", "integer"), ("delivery", "jsonb"), ("events_applied", "integer"),
    ("last_seq", "bigint"), ("state", "jsonb"),
)
RUN_COLUMNS = tuple(name for name, _ in RUN_COLUMN_DEFINITIONS)


def _field(name: str, kind: str) -> str:
    """A `runs` column read off the state document `x.state` (a JSON null: SQL NULL)."""
    if kind == "jsonb":
        return f"nullif(x.state->'{name}', 'null'::jsonb)"
    if kind == "text":
        return f"x.state->>'{name}'"
    return f"(x.state->>'{name}')::{kind}"


# What `upsert_runs` reads off a run's state document, by column: the same values as
# `projection.run_record` computes in Python for COPY (a test holds the two equal).
RUN_COLUMNS_FROM_STATE: dict[str, str] = {
    **{name: _field(name, kind) for name, kind in RUN_COLUMN_DEFINITIONS
       if name not in ("input_preview", "last_seq", "state")},
    "parent_agent": "x.state->'parent'->>'agent'",
    "parent_name": "x.state->'parent'->>'name'",
    "detached": "jsonb_typeof(x.state->'detached') = 'object'",
    "milestone_count": "jsonb_array_length(x.state->'milestones')",
    "output_chunks": "(SELECT count(*) FROM jsonb_object_keys(x.state->'output_parts'))",
    "step_count": "(SELECT count(*) FROM jsonb_object_keys(x.state->'steps'))",
    "delivery": "x.state->'ledger'",
    "state": "x.state",
}
