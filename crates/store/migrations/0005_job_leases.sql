-- Leases: a running job belongs to the worker named in `lease_owner` until `lease_expires_at`
-- (unix seconds), which that worker keeps pushing forward while it runs the job; once it has
-- passed (the worker died, hung or lost the database), any worker re-queues the job. Both are
-- NULL unless the job is running.
ALTER TABLE training_jobs ADD COLUMN lease_owner TEXT;
ALTER TABLE training_jobs ADD COLUMN lease_expires_at BIGINT;

-- One running job per model, whatever workers race to claim: a model's jobs run one at a time,
-- in order.
CREATE UNIQUE INDEX training_jobs_running_model ON training_jobs(model_id) WHERE status = 'running';
