-- Token usage per team, `OpenAI-Project` project, model and UTC hour (`bucket_start`, unix
-- seconds, a multiple of 3600): one row per combination rather than one per request, so the
-- table stays small. Every writer adds to the counters in one upsert
-- (`ON CONFLICT ... DO UPDATE SET x = token_usage.x + excluded.x`), so concurrent requests, and
-- several servers sharing one database, neither lose nor double a count. No foreign key to
-- `teams`: keys given on the command line act for team `default`, which may have no row.
CREATE TABLE token_usage (
    team                TEXT NOT NULL,
    project             TEXT NOT NULL,
    model               TEXT NOT NULL,
    bucket_start        BIGINT NOT NULL,
    input_tokens        BIGINT NOT NULL DEFAULT 0,
    cached_input_tokens BIGINT NOT NULL DEFAULT 0,
    output_tokens       BIGINT NOT NULL DEFAULT 0,
    num_model_requests  BIGINT NOT NULL DEFAULT 0,
    trained_tokens      BIGINT NOT NULL DEFAULT 0,
    num_gradient_steps  BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (team, bucket_start, project, model)
);

-- The operator's token quota of a team (`temper keys quota`) per UTC calendar month: prompt,
-- completion and trained tokens together. A team without a row has no quota.
CREATE TABLE team_quotas (
    team           TEXT PRIMARY KEY NOT NULL REFERENCES teams(name),
    monthly_tokens BIGINT NOT NULL CHECK (monthly_tokens >= 0),
    updated_at     BIGINT NOT NULL
);
