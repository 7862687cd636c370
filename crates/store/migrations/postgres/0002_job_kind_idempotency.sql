-- PostgreSQL's 0002_job_kind_idempotency.sql: BYTEA for BLOB, BIGINT times.
ALTER TABLE training_jobs ADD COLUMN kind TEXT NOT NULL DEFAULT 'rl' CHECK (kind IN ('rl', 'sft'));

CREATE TABLE idempotency_keys (
    team       TEXT NOT NULL REFERENCES teams(name),
    key        TEXT NOT NULL,
    route      TEXT NOT NULL,
    body_hash  BYTEA NOT NULL,
    status     INTEGER,
    response   BYTEA,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (team, key, route)
);
