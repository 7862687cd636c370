-- Teams own keys, models and jobs. A team row is created on first use (a key, a model).
CREATE TABLE teams (
    name       TEXT PRIMARY KEY NOT NULL,
    created_at INTEGER NOT NULL
);

-- Only the SHA-256 of a key's secret is kept; `prefix` lets a person tell keys apart.
CREATE TABLE api_keys (
    id          TEXT PRIMARY KEY NOT NULL,
    team        TEXT NOT NULL REFERENCES teams(name),
    prefix      TEXT NOT NULL,
    secret_hash BLOB NOT NULL UNIQUE,
    created_at  INTEGER NOT NULL,
    revoked_at  INTEGER
);
CREATE INDEX api_keys_team ON api_keys(team);

CREATE TABLE models (
    id         TEXT PRIMARY KEY NOT NULL,
    team       TEXT NOT NULL REFERENCES teams(name),
    project    TEXT NOT NULL,
    name       TEXT NOT NULL,
    base_model TEXT NOT NULL,
    run_id     TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    UNIQUE (team, project, name)
);

CREATE TABLE checkpoints (
    id         TEXT PRIMARY KEY NOT NULL,
    model_id   TEXT NOT NULL REFERENCES models(id) ON DELETE CASCADE,
    step       INTEGER NOT NULL,
    metrics    TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    UNIQUE (model_id, step)
);

-- `seq` orders the queue; `id` is the public UUID. No foreign key to models: a job outlives its
-- deleted model (it is failed, and stays readable).
CREATE TABLE training_jobs (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    id          TEXT NOT NULL UNIQUE,
    model_id    TEXT NOT NULL,
    team        TEXT NOT NULL REFERENCES teams(name),
    status      TEXT NOT NULL
                CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    step        INTEGER,
    error       TEXT,
    request     TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    started_at  INTEGER,
    finished_at INTEGER
);
CREATE INDEX training_jobs_status ON training_jobs(status, seq);
CREATE INDEX training_jobs_model ON training_jobs(model_id, seq);
CREATE INDEX training_jobs_team ON training_jobs(team, seq);

CREATE TABLE job_events (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id     TEXT NOT NULL REFERENCES training_jobs(id) ON DELETE CASCADE,
    type       TEXT NOT NULL,
    data       TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE INDEX job_events_job ON job_events(job_id, id);
