//! `temper keys` through the built binary, against a store in a temporary directory.

use std::path::Path;
use std::process::{Command, Output};

fn temper(home: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_temper"))
        .args(args)
        // Keep the default data dir inside the test's directory, whatever the caller's env says.
        .env("TEMPER_HOME", home)
        .env_remove("TEMPER_DATA_DIR")
        .env_remove("TEMPER_CONFIG")
        .env_remove("TEMPER_STORE")
        .output()
        .expect("run temper")
}

fn stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "temper failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn authenticate(data_dir: &Path, secret: &str) -> Option<String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = temper_store::Store::open(data_dir).await.unwrap();
        let team = store.authenticate(secret).await.unwrap().map(|t| t.name);
        store.close().await;
        team
    })
}

#[test]
fn create_list_revoke() {
    let home = tempfile::tempdir().unwrap();
    let dir = home.path().join("state");
    let dir_arg = dir.to_str().unwrap();

    let created = temper(
        home.path(),
        &["keys", "create", "--team", "acme", "--data-dir", dir_arg],
    );
    let secret = stdout(&created).trim().to_owned();
    assert!(
        secret.starts_with("tp-") && !secret.contains(char::is_whitespace),
        "{secret}"
    );
    assert!(String::from_utf8_lossy(&created.stderr).contains("cannot be shown again"));
    assert_eq!(authenticate(&dir, &secret).as_deref(), Some("acme"));
    let other = temper(
        home.path(),
        &["keys", "create", "--team", "globex", "--data-dir", dir_arg],
    );
    let other_secret = stdout(&other).trim().to_owned();

    let listed = stdout(&temper(
        home.path(),
        &["keys", "list", "--data-dir", dir_arg],
    ));
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 3, "{listed}");
    assert!(lines[0].starts_with("ID"));
    assert!(lines[1].contains("acme") && lines[1].contains(&secret[..9]));
    assert!(lines[1].ends_with("active"));
    assert!(!listed.contains(&secret), "list must not show secrets");
    let id = lines[1].split_whitespace().next().unwrap().to_owned();
    assert!(id.starts_with("key_"), "{id}");

    let only_globex = stdout(&temper(
        home.path(),
        &["keys", "list", "--team", "globex", "--data-dir", dir_arg],
    ));
    assert_eq!(only_globex.lines().count(), 2);
    assert!(only_globex.contains("globex") && !only_globex.contains("acme"));

    let revoked = stdout(&temper(
        home.path(),
        &["keys", "revoke", &id, "--data-dir", dir_arg],
    ));
    assert!(
        revoked.contains(&id) && revoked.contains("acme"),
        "{revoked}"
    );
    assert_eq!(authenticate(&dir, &secret), None);
    assert_eq!(authenticate(&dir, &other_secret).as_deref(), Some("globex"));
    let listed = stdout(&temper(
        home.path(),
        &["keys", "list", "--team", "acme", "--data-dir", dir_arg],
    ));
    assert!(
        listed.lines().nth(1).unwrap().ends_with("revoked"),
        "{listed}"
    );

    let missing = temper(
        home.path(),
        &["keys", "revoke", "key_missing", "--data-dir", dir_arg],
    );
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("key not found"));
    let bad = temper(
        home.path(),
        &["keys", "create", "--team", "a/b", "--data-dir", dir_arg],
    );
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("invalid team"));
}

#[test]
fn default_data_dir_is_the_servers() {
    let home = tempfile::tempdir().unwrap();
    let secret = stdout(&temper(home.path(), &["keys", "create", "--team", "t"]))
        .trim()
        .to_owned();
    // `temper serve` defaults to $TEMPER_HOME/data.
    assert!(home
        .path()
        .join("data")
        .join(temper_store::DB_FILE)
        .exists());
    assert_eq!(
        authenticate(&home.path().join("data"), &secret).as_deref(),
        Some("t")
    );

    // A config file's data_dir is honoured, as by `temper serve`.
    let config = home.path().join("temper.toml");
    let from_file = home.path().join("from-file");
    std::fs::write(
        &config,
        format!("data_dir = {:?}\n", from_file.to_str().unwrap()),
    )
    .unwrap();
    let secret = stdout(&temper(
        home.path(),
        &[
            "keys",
            "create",
            "--team",
            "f",
            "--config",
            config.to_str().unwrap(),
        ],
    ))
    .trim()
    .to_owned();
    assert_eq!(authenticate(&from_file, &secret).as_deref(), Some("f"));
}

fn stored_quota(data_dir: &Path, team: &str) -> Option<u64> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = temper_store::Store::open(data_dir).await.unwrap();
        let quota = store
            .quota(team, 0)
            .await
            .unwrap()
            .map(|q| q.monthly_tokens);
        store.close().await;
        quota
    })
}

#[test]
fn quota_set_show_clear() {
    let home = tempfile::tempdir().unwrap();
    let dir = home.path().join("state");
    let d = dir.to_str().unwrap();
    let run = |args: &[&str]| {
        temper(
            home.path(),
            &[&["keys", "quota", "--data-dir", d], args].concat(),
        )
    };

    let set = stdout(&run(&["--team", "acme", "--tokens", "5000"]));
    assert!(set.contains("acme") && set.contains("5000"), "{set}");
    assert_eq!(stored_quota(&dir, "acme"), Some(5000));
    stdout(&run(&["--team", "globex", "--tokens", "7"]));
    stdout(&run(&["--team", "acme", "--tokens", "6000"]));
    assert_eq!(stored_quota(&dir, "acme"), Some(6000));

    let all = stdout(&run(&[]));
    let lines: Vec<Vec<&str>> = all
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines.len(), 3, "{all}");
    assert_eq!(lines[0][..2], ["TEAM", "MONTHLY"]);
    assert_eq!(lines[1], ["acme", "6000", "0", "6000"]);
    assert_eq!(lines[2], ["globex", "7", "0", "7"]);
    let one = stdout(&run(&["--team", "globex"]));
    assert_eq!(one.lines().count(), 2, "{one}");

    assert!(stdout(&run(&["--team", "acme", "--clear"])).contains("removed"));
    assert_eq!(stored_quota(&dir, "acme"), None);
    assert!(stdout(&run(&["--team", "acme", "--clear"])).contains("no quota"));
    for bad in [
        &["--tokens", "5"][..],
        &["--clear"],
        &["--team", "acme", "--tokens", "5", "--clear"],
        &["--team", "acme", "--tokens", "-1"],
        &["--team", "a b", "--tokens", "1"],
    ] {
        assert!(!run(bad).status.success(), "{bad:?}");
    }
    assert_eq!(stored_quota(&dir, "globex"), Some(7));
}
