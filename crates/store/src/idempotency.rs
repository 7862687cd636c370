//! `Idempotency-Key`s: a retried request with the same key gets the first one's answer instead of
//! doing it again, across restarts. A key is claimed (its row inserted, the primary key making
//! concurrent claims exclusive) before the request is handled, completed with the answer once it
//! succeeded, or released when it failed so that a retry runs again.

use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::Row;

use crate::{ensure_team, now, Result, Store};

/// Longest accepted key, in bytes.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// Where a request with an `Idempotency-Key` stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The key is new: this request is to be handled, then [`Store::complete_idempotency`] or
    /// [`Store::release_idempotency`].
    Claimed,
    /// The same request already succeeded: its answer.
    Replay { status: u16, body: Vec<u8> },
    /// The key was used with another body.
    Mismatch,
    /// The first request with this key and body is still being handled.
    InProgress,
}

/// One key of one team on one route (e.g. `POST /v1/preview/training-jobs`).
#[derive(Debug, Clone, Copy)]
pub struct IdempotencyKey<'a> {
    pub team: &'a str,
    pub key: &'a str,
    pub route: &'a str,
}

impl Store {
    /// Claims `key` for a request with `body`, or says why not.
    pub async fn claim_idempotency(&self, key: IdempotencyKey<'_>, body: &[u8]) -> Result<Claim> {
        let hash = Sha256::digest(body).to_vec();
        loop {
            let at = now();
            let mut tx = self.write_tx().await?;
            ensure_team(&mut tx, key.team, at).await?;
            // On PostgreSQL a concurrent claim of the key makes this wait for its outcome.
            let inserted = sqlx::query(
                "INSERT INTO idempotency_keys (team, key, route, body_hash, created_at) \
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
            )
            .bind(key.team)
            .bind(key.key)
            .bind(key.route)
            .bind(&hash)
            .bind(at)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            let claim = if inserted == 1 {
                Claim::Claimed
            } else {
                let row = sqlx::query(
                    "SELECT body_hash, status, response FROM idempotency_keys \
                     WHERE team = $1 AND key = $2 AND route = $3",
                )
                .bind(key.team)
                .bind(key.key)
                .bind(key.route)
                .fetch_optional(&mut *tx)
                .await?;
                // Released between the insert and this read (PostgreSQL runs them side by
                // side): the key is free, claim it again.
                let Some(row) = row else { continue };
                let stored: Vec<u8> = row.try_get("body_hash")?;
                let status: Option<i64> = row.try_get("status")?;
                match status {
                    _ if stored != hash => Claim::Mismatch,
                    None => Claim::InProgress,
                    Some(status) => Claim::Replay {
                        status: u16::try_from(status).map_err(|_| {
                            crate::Error::Corrupt(format!("idempotent answer status {status}"))
                        })?,
                        body: row
                            .try_get::<Option<Vec<u8>>, _>("response")?
                            .unwrap_or_default(),
                    },
                }
            };
            tx.commit().await?;
            return Ok(claim);
        }
    }

    /// Records the answer of a claimed key's request, replayed to every retry from now on. A
    /// key already answered (see [`Store::enqueue_job_idempotent`]) keeps its answer.
    pub async fn complete_idempotency(
        &self,
        key: IdempotencyKey<'_>,
        status: u16,
        body: &[u8],
    ) -> Result<()> {
        let mut conn = self.pool.acquire().await?;
        complete(&mut conn, key, status, body).await
    }

    /// Forgets a claimed key whose request failed, so that a retry is handled afresh.
    pub async fn release_idempotency(&self, key: IdempotencyKey<'_>) -> Result<()> {
        sqlx::query(
            "DELETE FROM idempotency_keys \
             WHERE team = $1 AND key = $2 AND route = $3 AND status IS NULL",
        )
        .bind(key.team)
        .bind(key.key)
        .bind(key.route)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

/// At start-up (with [`Store::recover_after_crash`]): claims whose request a crash cut short
/// never got an answer, so the client retries them; they are forgotten rather than left "in
/// progress" for ever.
pub(crate) async fn release_unfinished(conn: &mut sqlx::AnyConnection) -> Result<()> {
    sqlx::query("DELETE FROM idempotency_keys WHERE status IS NULL")
        .execute(conn)
        .await?;
    Ok(())
}

impl Store {
    /// Forgets the claims still unanswered `older_than` after they were made: their server died
    /// handling the request (a store that servers share has no start-up that could tell, as
    /// [`Store::recover_after_crash`] does). `older_than` must exceed the longest a request
    /// holds its claim. Returns how many were released.
    pub async fn release_stale_idempotency_claims(&self, older_than: Duration) -> Result<u64> {
        let before = now().saturating_sub(i64::try_from(older_than.as_secs()).unwrap_or(i64::MAX));
        Ok(
            sqlx::query("DELETE FROM idempotency_keys WHERE status IS NULL AND created_at <= $1")
                .bind(before)
                .execute(&self.pool)
                .await?
                .rows_affected(),
        )
    }
}

pub(crate) async fn complete(
    conn: &mut sqlx::AnyConnection,
    key: IdempotencyKey<'_>,
    status: u16,
    body: &[u8],
) -> Result<()> {
    sqlx::query(
        "UPDATE idempotency_keys SET status = $1, response = $2 \
         WHERE team = $3 AND key = $4 AND route = $5 AND status IS NULL",
    )
    .bind(i64::from(status))
    .bind(body)
    .bind(key.team)
    .bind(key.key)
    .bind(key.route)
    .execute(conn)
    .await?;
    Ok(())
}
