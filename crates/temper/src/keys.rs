//! `temper keys create|list|revoke|quota`: team API keys and token quotas in the server's store.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use temper_store::{KeyInfo, Quota, Store, StoreLocation};

use crate::config;

#[derive(Debug, Args)]
pub struct KeysArgs {
    #[command(subcommand)]
    command: KeysCommand,
    /// The server's state directory [default: as `temper serve`: the config file's `data_dir`,
    /// else $TEMPER_HOME/data].
    #[arg(long, env = "TEMPER_DATA_DIR", value_name = "DIR", global = true)]
    data_dir: Option<PathBuf>,
    /// The server's PostgreSQL store (a postgres:// URL), as `temper serve --store` [default:
    /// the config file's `store`, else the SQLite file in the data directory].
    #[arg(
        long,
        env = "TEMPER_STORE",
        value_name = "URL",
        global = true,
        hide_env_values = true
    )]
    store: Option<String>,
    /// `temper serve`'s TOML file, read for its `data_dir` and `store`.
    #[arg(long, env = "TEMPER_CONFIG", value_name = "FILE", global = true)]
    config: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// Create a key for a team and print it (on stdout, alone); it is shown only this once.
    Create {
        /// The team (1-64 of A-Z a-z 0-9 - _ .); created on first use.
        #[arg(long)]
        team: String,
    },
    /// List keys (never their secrets): id, team, prefix, creation time, status.
    List {
        /// Only this team's keys.
        #[arg(long)]
        team: Option<String>,
    },
    /// Revoke a key by id; it stops authenticating at once.
    Revoke {
        /// The key's id (`key_…`, from `temper keys list`).
        id: String,
    },
    /// Set (--tokens) or remove (--clear) a team's monthly token quota, or show quotas and use
    ///
    /// A quota counts prompt, completion and trained tokens per UTC calendar month; past it the
    /// team's chat completions and training job posts get a 429 until the next month.
    Quota {
        /// The team; without --tokens or --clear, show only its quota.
        #[arg(long, required_if_eq_any([("clear", "true")]))]
        team: Option<String>,
        /// Prompt, completion and trained tokens the team may use per UTC calendar month.
        #[arg(long, requires = "team", conflicts_with = "clear")]
        tokens: Option<u64>,
        /// Remove the team's quota.
        #[arg(long)]
        clear: bool,
    },
}

pub fn run(args: KeysArgs) -> Result<(), String> {
    // The same precedence as `temper serve`: flag/env, then the config file, then the default.
    let file = match &args.config {
        Some(path) => config::read_file(path).map_err(|e| e.to_string())?,
        None => config::FileConfig::default(),
    };
    let location = match args.store.or(file.store) {
        Some(url) => StoreLocation::parse_url(&url).map_err(|e| format!("--store: {e}"))?,
        None => StoreLocation::Sqlite(
            args.data_dir
                .or(file.data_dir)
                .unwrap_or_else(|| config::temper_home().join("data")),
        ),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    // No data-directory lock (`temper serve` holds it for its whole life): keys are managed
    // while the server runs, the database orders the two processes' writes, and opening the
    // store here runs no crash recovery, so nothing of the server's jobs is touched.
    runtime.block_on(async {
        let store = Store::connect(&location)
            .await
            .map_err(|e| format!("opening the store {location}: {e}"))?;
        let result = command(&store, args.command).await;
        store.close().await;
        result
    })
}

async fn command(store: &Store, command: KeysCommand) -> Result<(), String> {
    match command {
        KeysCommand::Create { team } => {
            let (key, secret) = store.create_key(&team).await.map_err(|e| e.to_string())?;
            // The secret alone on stdout, so `KEY=$(temper keys create --team T)` works.
            println!("{secret}");
            eprintln!(
                "created key {} for team {}; store it now: it cannot be shown again",
                key.id, key.team
            );
        }
        KeysCommand::List { team } => {
            let keys = store
                .list_keys(team.as_deref())
                .await
                .map_err(|e| e.to_string())?;
            print!("{}", table(&keys));
        }
        KeysCommand::Revoke { id } => {
            let key = store.revoke_key(&id).await.map_err(|e| e.to_string())?;
            println!("revoked {} (team {})", key.id, key.team);
        }
        KeysCommand::Quota {
            team,
            tokens,
            clear,
        } => quota(store, team, tokens, clear).await?,
    }
    Ok(())
}

async fn quota(
    store: &Store,
    team: Option<String>,
    tokens: Option<u64>,
    clear: bool,
) -> Result<(), String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    match (team, tokens, clear) {
        (Some(team), Some(tokens), _) => {
            store
                .set_quota(&team, Some(tokens))
                .await
                .map_err(|e| e.to_string())?;
            println!("team {team}: {tokens} tokens a month (UTC)");
        }
        (Some(team), None, true) => {
            let had = store
                .set_quota(&team, None)
                .await
                .map_err(|e| e.to_string())?;
            match had {
                true => println!("team {team}: quota removed"),
                false => println!("team {team} had no quota"),
            }
        }
        (team, _, _) => {
            let quotas = match team {
                Some(team) => store
                    .quota(&team, now)
                    .await
                    .map_err(|e| e.to_string())?
                    .into_iter()
                    .collect(),
                None => store.list_quotas(now).await.map_err(|e| e.to_string())?,
            };
            print!("{}", quota_table(&quotas, now));
        }
    }
    Ok(())
}

fn quota_table(quotas: &[Quota], now: i64) -> String {
    let (year, month, _) = temper_store::utc_date(now);
    let mut rows = vec![[
        "TEAM".to_owned(),
        "MONTHLY TOKENS".to_owned(),
        format!("USED {year:04}-{month:02}"),
        "REMAINING".to_owned(),
    ]];
    for q in quotas {
        rows.push([
            q.team.clone(),
            q.monthly_tokens.to_string(),
            q.used_tokens.to_string(),
            q.monthly_tokens.saturating_sub(q.used_tokens).to_string(),
        ]);
    }
    aligned(&rows)
}

fn table(keys: &[KeyInfo]) -> String {
    let mut rows = vec![[
        "ID".to_owned(),
        "TEAM".to_owned(),
        "PREFIX".to_owned(),
        "CREATED (UTC)".to_owned(),
        "STATUS".to_owned(),
    ]];
    for k in keys {
        rows.push([
            k.id.clone(),
            k.team.clone(),
            k.prefix.clone(),
            utc(k.created_at),
            if k.revoked { "revoked" } else { "active" }.to_owned(),
        ]);
    }
    aligned(&rows)
}

/// Rows as left-aligned columns two spaces apart.
fn aligned<const N: usize>(rows: &[[String; N]]) -> String {
    let mut widths = [0usize; N];
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// Unix seconds as `YYYY-MM-DD HH:MM:SS` (UTC), without a date library for one column.
fn utc(secs: i64) -> String {
    let (year, month, day) = temper_store::utc_date(secs);
    let rem = secs.rem_euclid(86_400);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(utc(1_763_769_599), "2025-11-21 23:59:59");
    }

    #[test]
    fn table_aligns_columns() {
        let keys = [KeyInfo {
            id: "key_1".into(),
            team: "a".into(),
            prefix: "tp-abcdef".into(),
            created_at: 0,
            revoked: true,
        }];
        assert_eq!(
            table(&keys),
            "ID     TEAM  PREFIX     CREATED (UTC)        STATUS\n\
             key_1  a     tp-abcdef  1970-01-01 00:00:00  revoked\n"
        );
    }

    #[test]
    fn quota_table_shows_what_is_left() {
        let quotas = [Quota {
            team: "acme".into(),
            monthly_tokens: 1000,
            used_tokens: 1200,
            period_start: 0,
            period_end: 2_678_400,
        }];
        assert_eq!(
            quota_table(&quotas, 5),
            "TEAM  MONTHLY TOKENS  USED 1970-01  REMAINING\n\
             acme  1000            1200          0\n"
        );
    }
}
