-- The fencing tokens of the leases that write this schema (tether.leadership): the
-- projector takes the next term when it starts to lead, and each of its batches commits
-- only while the term is still its own, so a deposed projector's batch that raced its
-- lease's end rolls back instead of landing.
CREATE TABLE leases (
    name text   PRIMARY KEY,
    term bigint NOT NULL
);
