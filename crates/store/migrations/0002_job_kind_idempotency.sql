-- What a job trains: `rl` (trajectory groups, training.md's loss) or `sft` (cross-entropy on the
-- assistant turns). Jobs queued before this migration are RL jobs.
ALTER TABLE training_jobs ADD COLUMN kind TEXT NOT NULL DEFAULT 'rl' CHECK (kind IN ('rl', 'sft'));

-- `Idempotency-Key`s of the training API, per team and route (method and path): the first
-- request's body hash and, once it succeeded, its answer, replayed to a retry with the same key.
-- `status` is NULL while that first request is being handled.
CREATE TABLE idempotency_keys (
    team       TEXT NOT NULL REFERENCES teams(name),
    key        TEXT NOT NULL,
    route      TEXT NOT NULL,
    body_hash  BLOB NOT NULL,
    status     INTEGER,
    response   BLOB,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (team, key, route)
);
