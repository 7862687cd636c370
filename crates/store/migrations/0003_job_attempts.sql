-- How many times a worker has started (claimed) the job. A job found `running` at start-up was
-- interrupted by a crash or a kill that many times in a row: at the server's
-- `--max-job-attempts` it is failed instead of re-queued once more. Existing jobs start at 0.
ALTER TABLE training_jobs ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
