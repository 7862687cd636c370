//! `temper keys create|list|revoke`: team API keys in the server's store.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use temper_store::{KeyInfo, Store, StoreLocation};

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
    }
    Ok(())
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
    let mut widths = [0usize; 5];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    for row in &rows {
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
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
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
}
