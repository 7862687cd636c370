//! Teams and API keys. A key's secret is shown once, at creation; only its SHA-256 is stored.
//! Secrets are 32 random bytes, so a plain hash (no salt, no slow KDF) cannot be brute-forced.

use sha2::{Digest, Sha256};
use sqlx::Row;

use crate::{ensure_team, hex, now, random_bytes, Error, Result, Store};

/// Every secret starts with this, so a leaked key is recognisable (e.g. by secret scanners).
pub const SECRET_PREFIX: &str = "tp-";
/// Characters of the secret kept in the clear (`tp-` and 6 hex digits) to tell keys apart.
const SHOWN_PREFIX_LEN: usize = SECRET_PREFIX.len() + 6;

/// The team a key authenticates as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Team {
    pub name: String,
}

/// A key as listed: never its secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    pub id: String,
    pub team: String,
    /// The first characters of the secret.
    pub prefix: String,
    pub created_at: i64,
    pub revoked: bool,
}

fn hash(secret: &str) -> Vec<u8> {
    Sha256::digest(secret.as_bytes()).to_vec()
}

fn key_info(row: &sqlx::any::AnyRow) -> Result<KeyInfo> {
    Ok(KeyInfo {
        id: row.try_get("id")?,
        team: row.try_get("team")?,
        prefix: row.try_get("prefix")?,
        created_at: row.try_get("created_at")?,
        revoked: row.try_get::<Option<i64>, _>("revoked_at")?.is_some(),
    })
}

impl Store {
    /// Creates a key for `team` (creating the team on first use). Returns the key and its secret;
    /// the secret is not stored and cannot be shown again.
    pub async fn create_key(&self, team: &str) -> Result<(KeyInfo, String)> {
        let secret = format!("{SECRET_PREFIX}{}", hex(&random_bytes::<32>()?));
        let info = KeyInfo {
            id: format!("key_{}", hex(&random_bytes::<8>()?)),
            team: team.to_owned(),
            prefix: secret[..SHOWN_PREFIX_LEN].to_owned(),
            created_at: now(),
            revoked: false,
        };
        let mut tx = self.write_tx().await?;
        ensure_team(&mut tx, team, info.created_at).await?;
        sqlx::query(
            "INSERT INTO api_keys (id, team, prefix, secret_hash, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&info.id)
        .bind(team)
        .bind(&info.prefix)
        .bind(hash(&secret))
        .bind(info.created_at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok((info, secret))
    }

    /// The team of an unrevoked key with this secret. The lookup is by the secret's hash, so
    /// timing reveals nothing about the secret itself.
    pub async fn authenticate(&self, secret: &str) -> Result<Option<Team>> {
        let team: Option<String> = sqlx::query_scalar(
            "SELECT team FROM api_keys WHERE secret_hash = $1 AND revoked_at IS NULL",
        )
        .bind(hash(secret))
        .fetch_optional(&self.pool)
        .await?;
        Ok(team.map(|name| Team { name }))
    }

    /// Whether any unrevoked key exists (then the server asks every request for one).
    pub async fn has_active_keys(&self) -> Result<bool> {
        let any: Option<i64> =
            sqlx::query_scalar("SELECT 1 FROM api_keys WHERE revoked_at IS NULL LIMIT 1")
                .fetch_optional(&self.pool)
                .await?;
        Ok(any.is_some())
    }

    /// Keys, oldest first: all of them, or one team's.
    pub async fn list_keys(&self, team: Option<&str>) -> Result<Vec<KeyInfo>> {
        let rows = sqlx::query(
            "SELECT id, team, prefix, created_at, revoked_at FROM api_keys \
             WHERE $1 IS NULL OR team = $1 ORDER BY created_at, rowid",
        )
        .bind(team)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(key_info).collect()
    }

    /// Revokes a key (again is a no-op). Its secret stops authenticating at once.
    pub async fn revoke_key(&self, id: &str) -> Result<KeyInfo> {
        let row = sqlx::query(
            "UPDATE api_keys SET revoked_at = coalesce(revoked_at, $1) WHERE id = $2 \
             RETURNING id, team, prefix, created_at, revoked_at",
        )
        .bind(now())
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some(row) => key_info(&row),
            None => Err(Error::NotFound("key")),
        }
    }
}
