//! Token usage per team, `OpenAI-Project` project, model and UTC hour, and each team's monthly
//! token quota (`temper keys quota`).
//!
//! Counters are only ever added to, in one upsert per row, so concurrent writers (requests,
//! the training worker, several servers on one database) neither lose nor double a count. The
//! SQL is plain enough for SQLite and PostgreSQL alike.

use std::ops::AddAssign;

use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{ensure_team, invalid, now, Result, Store};

/// A usage row's time bucket: the UTC hour.
pub const USAGE_BUCKET_SECONDS: i64 = 3600;

const DAY_SECONDS: i64 = 86_400;

/// What a team used in one bucket (or a sum of buckets).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenCounts {
    /// Prompt tokens of chat completions, the cached ones included.
    pub input_tokens: u64,
    /// Those of them the prefix cache held.
    pub cached_input_tokens: u64,
    /// Generated tokens, every choice.
    pub output_tokens: u64,
    /// Chat completions the engine accepted.
    pub num_model_requests: u64,
    /// `num_trainable_tokens` of training jobs' `gradient_step` events.
    pub trained_tokens: u64,
    pub num_gradient_steps: u64,
}

impl AddAssign for TokenCounts {
    fn add_assign(&mut self, o: TokenCounts) {
        self.input_tokens += o.input_tokens;
        self.cached_input_tokens += o.cached_input_tokens;
        self.output_tokens += o.output_tokens;
        self.num_model_requests += o.num_model_requests;
        self.trained_tokens += o.trained_tokens;
        self.num_gradient_steps += o.num_gradient_steps;
    }
}

/// Where usage is counted: a team's project, a model, an hour.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UsageKey {
    pub team: String,
    pub project: String,
    /// The served name: a base model, or a trained model as `<team>/<project>/<name>` (with
    /// `:step<N>` for the checkpoint a chat completion used).
    pub model: String,
    /// The UTC hour's first second (see [`usage_bucket`]).
    pub bucket_start: i64,
}

/// One stored row of a team's usage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRow {
    pub bucket_start: i64,
    pub project: String,
    pub model: String,
    pub counts: TokenCounts,
}

/// A team's monthly token quota and what it used of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quota {
    pub team: String,
    pub monthly_tokens: u64,
    /// Prompt, completion and trained tokens in the period.
    pub used_tokens: u64,
    /// The UTC calendar month: its first second, and the next month's.
    pub period_start: i64,
    pub period_end: i64,
}

impl Quota {
    pub fn is_exceeded(&self) -> bool {
        self.used_tokens >= self.monthly_tokens
    }
}

/// The bucket (UTC hour) holding unix time `t`.
pub fn usage_bucket(t: i64) -> i64 {
    t - t.rem_euclid(USAGE_BUCKET_SECONDS)
}

/// The UTC calendar date `(year, month 1-12, day 1-31)` of unix time `t`.
pub fn utc_date(t: i64) -> (i64, u32, u32) {
    // Howard Hinnant's days-to-civil algorithm.
    let z = t.div_euclid(DAY_SECONDS) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// Unix time of 00:00 UTC on the first of `month` (1-12) of `year` (civil-to-days, inverted).
fn month_start(year: i64, month: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let mp = i64::from(if month > 2 { month - 3 } else { month + 9 });
    let doy = (153 * mp + 2) / 5;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe - 719_468) * DAY_SECONDS
}

/// The UTC calendar month holding unix time `t`: its first second and the next month's.
pub fn utc_month(t: i64) -> (i64, i64) {
    let (year, month, _) = utc_date(t);
    let next = if month == 12 {
        (year + 1, 1)
    } else {
        (year, month + 1)
    };
    (month_start(year, month), month_start(next.0, next.1))
}

fn to_db(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn from_db(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// The `ON CONFLICT` clause of every usage write: each counter adds the new row's.
macro_rules! add_on_conflict {
    () => {
        " ON CONFLICT (team, bucket_start, project, model) DO UPDATE SET \
         input_tokens = token_usage.input_tokens + excluded.input_tokens, \
         cached_input_tokens = token_usage.cached_input_tokens + excluded.cached_input_tokens, \
         output_tokens = token_usage.output_tokens + excluded.output_tokens, \
         num_model_requests = token_usage.num_model_requests + excluded.num_model_requests, \
         trained_tokens = token_usage.trained_tokens + excluded.trained_tokens, \
         num_gradient_steps = token_usage.num_gradient_steps + excluded.num_gradient_steps"
    };
}

/// The `num_trainable_tokens` of a `gradient_step` event, added to the usage of its job's model
/// (team, project, `<team>/<project>/<name>`) in the caller's transaction, the one that appends
/// the event: the event and its count commit together.
pub(crate) async fn add_trained_tokens(
    conn: &mut sqlx::AnyConnection,
    job_id: &str,
    data: &serde_json::Value,
    at: i64,
) -> Result<()> {
    let tokens = data
        .get("num_trainable_tokens")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0);
    sqlx::query(concat!(
        "INSERT INTO token_usage (team, project, model, bucket_start, trained_tokens, \
         num_gradient_steps) \
         SELECT m.team, m.project, m.team || '/' || m.project || '/' || m.name, $1, $2, 1 \
         FROM training_jobs j JOIN models m ON m.id = j.model_id WHERE j.id = $3",
        add_on_conflict!()
    ))
    .bind(usage_bucket(at))
    .bind(to_db(tokens))
    .bind(job_id)
    .execute(conn)
    .await?;
    Ok(())
}

fn quota_row(row: &AnyRow, period: (i64, i64)) -> Result<Quota> {
    Ok(Quota {
        team: row.try_get("team")?,
        monthly_tokens: from_db(row.try_get("monthly_tokens")?),
        used_tokens: from_db(row.try_get("used_tokens")?),
        period_start: period.0,
        period_end: period.1,
    })
}

/// Quotas with their use in the month `$1, $2` (bound first).
macro_rules! quota_query {
    () => {
        "SELECT q.team, q.monthly_tokens, COALESCE((SELECT CAST(SUM(u.input_tokens + \
         u.output_tokens + u.trained_tokens) AS BIGINT) FROM token_usage u WHERE u.team = q.team \
         AND u.bucket_start >= $1 AND u.bucket_start < $2), 0) AS used_tokens FROM team_quotas q"
    };
}

impl Store {
    /// Adds each key's counts to its row, all in one transaction. Rows are written in key
    /// order, so concurrent writers on PostgreSQL lock them in one order and never deadlock.
    pub async fn add_usage(&self, usage: &[(UsageKey, TokenCounts)]) -> Result<()> {
        let mut sorted: Vec<&(UsageKey, TokenCounts)> = usage.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        let mut tx = self.write_tx().await?;
        for (key, c) in sorted {
            sqlx::query(concat!(
                "INSERT INTO token_usage (team, project, model, bucket_start, input_tokens, \
                 cached_input_tokens, output_tokens, num_model_requests, trained_tokens, \
                 num_gradient_steps) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                add_on_conflict!()
            ))
            .bind(&key.team)
            .bind(&key.project)
            .bind(&key.model)
            .bind(key.bucket_start)
            .bind(to_db(c.input_tokens))
            .bind(to_db(c.cached_input_tokens))
            .bind(to_db(c.output_tokens))
            .bind(to_db(c.num_model_requests))
            .bind(to_db(c.trained_tokens))
            .bind(to_db(c.num_gradient_steps))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// A team's usage rows whose hour starts in `[from, to)`, by hour, project and model.
    pub async fn usage_rows(&self, team: &str, from: i64, to: i64) -> Result<Vec<UsageRow>> {
        let rows = sqlx::query(
            "SELECT bucket_start, project, model, input_tokens, cached_input_tokens, \
             output_tokens, num_model_requests, trained_tokens, num_gradient_steps \
             FROM token_usage WHERE team = $1 AND bucket_start >= $2 AND bucket_start < $3 \
             ORDER BY bucket_start, project, model",
        )
        .bind(team)
        .bind(from)
        .bind(to)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let count = |column: &str| row.try_get::<i64, _>(column).map(from_db);
                Ok(UsageRow {
                    bucket_start: row.try_get("bucket_start")?,
                    project: row.try_get("project")?,
                    model: row.try_get("model")?,
                    counts: TokenCounts {
                        input_tokens: count("input_tokens")?,
                        cached_input_tokens: count("cached_input_tokens")?,
                        output_tokens: count("output_tokens")?,
                        num_model_requests: count("num_model_requests")?,
                        trained_tokens: count("trained_tokens")?,
                        num_gradient_steps: count("num_gradient_steps")?,
                    },
                })
            })
            .collect()
    }

    /// Sets a team's monthly token quota (creating the team on first use), or with `None`
    /// removes it. Returns whether the team had one before.
    pub async fn set_quota(&self, team: &str, monthly_tokens: Option<u64>) -> Result<bool> {
        let at = now();
        let mut tx = self.write_tx().await?;
        let had: Option<i64> = sqlx::query_scalar("SELECT 1 FROM team_quotas WHERE team = $1")
            .bind(team)
            .fetch_optional(&mut *tx)
            .await?;
        match monthly_tokens {
            Some(tokens) => {
                let tokens = i64::try_from(tokens)
                    .map_err(|_| invalid("tokens", format!("{tokens} is too large")))?;
                ensure_team(&mut tx, team, at).await?;
                sqlx::query(
                    "INSERT INTO team_quotas (team, monthly_tokens, updated_at) VALUES ($1, $2, $3) \
                     ON CONFLICT (team) DO UPDATE SET monthly_tokens = excluded.monthly_tokens, \
                     updated_at = excluded.updated_at",
                )
                .bind(team)
                .bind(tokens)
                .bind(at)
                .execute(&mut *tx)
                .await?;
            }
            None => {
                sqlx::query("DELETE FROM team_quotas WHERE team = $1")
                    .bind(team)
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await?;
        Ok(had.is_some())
    }

    /// A team's quota and its use in the UTC month holding unix time `at`; `None` without one.
    pub async fn quota(&self, team: &str, at: i64) -> Result<Option<Quota>> {
        let period = utc_month(at);
        let row = sqlx::query(concat!(quota_query!(), " WHERE q.team = $3"))
            .bind(period.0)
            .bind(period.1)
            .bind(team)
            .fetch_optional(&self.pool)
            .await?;
        row.map(|row| quota_row(&row, period)).transpose()
    }

    /// Every team's quota and its use in the UTC month holding `at`, by team.
    pub async fn list_quotas(&self, at: i64) -> Result<Vec<Quota>> {
        let period = utc_month(at);
        let rows = sqlx::query(concat!(quota_query!(), " ORDER BY q.team"))
            .bind(period.0)
            .bind(period.1)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(|row| quota_row(row, period)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_months() {
        // 2024-02-29 12:00 UTC: a leap February.
        let t = 1_709_208_000;
        assert_eq!(utc_date(t), (2024, 2, 29));
        assert_eq!(utc_month(t), (1_706_745_600, 1_709_251_200));
        assert_eq!(utc_date(1_709_251_200), (2024, 3, 1));
        // December rolls into the next year.
        assert_eq!(utc_month(1_735_603_200), (1_733_011_200, 1_735_689_600));
        assert_eq!(utc_date(1_735_689_600), (2025, 1, 1));
        assert_eq!(utc_month(0), (0, 31 * DAY_SECONDS));
        assert_eq!(utc_date(-1), (1969, 12, 31));
        // Every month of 400 years starts on a day boundary, the 1st, after the previous one.
        let mut t = 0;
        for _ in 0..12 * 400 {
            let (start, end) = utc_month(t);
            assert_eq!(start, t);
            assert_eq!(utc_date(start).2, 1);
            assert!((28..=31).contains(&((end - start) / DAY_SECONDS)));
            assert_eq!(utc_date(end - 1).0 * 12 + i64::from(utc_date(end - 1).1), {
                let (y, m, _) = utc_date(start);
                y * 12 + i64::from(m)
            });
            t = end;
        }
    }

    #[test]
    fn buckets_are_utc_hours() {
        assert_eq!(usage_bucket(7_199), 3_600);
        assert_eq!(usage_bucket(7_200), 7_200);
        assert_eq!(usage_bucket(-1), -3_600);
    }
}
