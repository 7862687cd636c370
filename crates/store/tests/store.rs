//! The store on both backends: each test runs on a real SQLite file in a temporary directory
//! (`<test>::sqlite`) and on a fresh database of the PostgreSQL server at
//! `TEMPER_TEST_POSTGRES_URL` (`<test>::postgres`; `scripts/with-postgres.sh` starts one). Without
//! that variable the PostgreSQL variants print why they skip, unless `TEMPER_REQUIRE_POSTGRES=1`
//! (`make test`): then they fail.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod common;

use common::{on_both_backends, Db};
use serde_json::json;
use sqlx::Connection;
use temper_store::{event, Error, JobStatus, Model, NewModel, Order, Store, StoreLocation};
use uuid::Uuid;

/// The worker of the tests that need one.
const W: &str = "worker-1";
/// A lease no test outlives.
const LEASE: Duration = Duration::from_secs(600);

on_both_backends!(
    keys_create_authenticate_revoke,
    another_teams_rows_are_not_found,
    model_names_are_unique_per_team,
    checkpoint_pagination,
    delete_checkpoints_reports_missing_steps,
    jobs_run_in_order_per_model,
    events_after_is_idempotent,
    accepted_jobs_survive_a_crash_and_running_ones_are_requeued,
    claims_count_attempts_and_a_job_running_at_max_attempts_crashes_fails,
    a_job_requeued_at_shutdown_gets_its_attempt_back,
    concurrent_claims_take_one_job_per_model,
    a_killed_process_loses_no_accepted_job,
    jobs_keep_their_kind_and_request_across_a_reopen,
    idempotency_keys_claim_replay_mismatch_and_release,
    a_job_and_its_idempotent_answer_commit_together,
    a_team_past_its_queued_job_limit_is_refused_and_others_are_not,
    concurrent_posts_never_pass_the_team_queue_limit,
    workers_on_separate_connections_never_share_a_job_nor_a_model,
    an_expired_lease_requeues_the_job_with_an_event_and_another_worker_finishes_it,
    a_renewed_lease_keeps_its_job,
    jobs_whose_worker_is_lost_at_max_attempts_fail,
    shutdown_requeues_only_the_workers_own_jobs,
    stale_idempotency_claims_are_released,
    training_totals_count_jobs_steps_and_tokens,
    a_model_deleted_amid_posts_and_a_finishing_job_leaves_none_pending,
    an_import_takes_the_next_step_and_holds_the_model_until_it_commits,
);

async fn model(store: &Store, team: &str, name: &str) -> Model {
    store
        .create_model(&NewModel {
            team,
            project: "proj",
            name,
            base_model: "gemma-3-270m",
        })
        .await
        .expect("create model")
}

/// Runs one job of `model` to a new checkpoint at `step`.
async fn train(store: &Store, model: &Model, step: i64) -> Uuid {
    let job = store
        .enqueue_job(
            &model.team,
            model.id,
            temper_store::JobKind::Rl,
            r#"{"trajectory_groups": []}"#,
        )
        .await
        .unwrap();
    let claimed = store
        .claim_next_job(W, LEASE)
        .await
        .unwrap()
        .expect("a queued job");
    assert_eq!(claimed.id, job.id);
    store
        .succeed_job(
            job.id,
            W,
            step,
            Some(json!({ "reward": step })),
            &json!({ "step": step }),
        )
        .await
        .unwrap();
    job.id
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

async fn keys_create_authenticate_revoke(db: Db) {
    let store = db.open().await;
    assert!(!store.has_active_keys().await.unwrap());
    let (key, secret) = store.create_key("acme").await.unwrap();
    assert!(store.has_active_keys().await.unwrap());
    let (other, other_secret) = store.create_key("globex").await.unwrap();
    assert_eq!(other.team, "globex");
    assert!(
        secret.starts_with("tp-") && secret.len() == 3 + 64,
        "{secret}"
    );
    assert!(secret.starts_with(&key.prefix));
    assert_ne!(secret, other_secret);
    assert_eq!(key.team, "acme");
    assert!(!key.revoked);

    let team = store
        .authenticate(&secret)
        .await
        .unwrap()
        .expect("valid key");
    assert_eq!(team.name, "acme");
    assert_eq!(
        store
            .authenticate(&other_secret)
            .await
            .unwrap()
            .unwrap()
            .name,
        "globex"
    );
    assert_eq!(store.authenticate("tp-nope").await.unwrap(), None);
    assert_eq!(store.authenticate(&secret[..20]).await.unwrap(), None);

    let all = store.list_keys(None).await.unwrap();
    assert_eq!(all.len(), 2);
    let acme = store.list_keys(Some("acme")).await.unwrap();
    assert_eq!(acme, vec![key.clone()]);

    // Only the hash is stored: the secret's bytes are nowhere in the database files.
    let bytes = db.stored_key_bytes().await;
    assert!(
        contains(&bytes, key.prefix.as_bytes()),
        "the grep must see the rows"
    );
    assert!(!contains(&bytes, secret.as_bytes()));
    assert!(!contains(&bytes, &secret.as_bytes()[3..]));

    let revoked = store.revoke_key(&key.id).await.unwrap();
    assert!(revoked.revoked);
    assert_eq!(store.authenticate(&secret).await.unwrap(), None);
    assert!(store.authenticate(&other_secret).await.unwrap().is_some());
    assert!(store.list_keys(Some("acme")).await.unwrap()[0].revoked);
    assert!(store.has_active_keys().await.unwrap());
    store.revoke_key(&other.id).await.unwrap();
    assert!(!store.has_active_keys().await.unwrap());
    // Revoking again is harmless; an unknown id is not found.
    assert!(store.revoke_key(&key.id).await.unwrap().revoked);
    assert!(matches!(
        store.revoke_key("key_missing").await,
        Err(Error::NotFound("key"))
    ));
    assert!(matches!(
        store.create_key("bad/team").await,
        Err(Error::Invalid { field: "team", .. })
    ));
}

async fn another_teams_rows_are_not_found(db: Db) {
    let store = db.open().await;
    let m = model(&store, "acme", "agent").await;
    let job = store
        .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();

    let nf = |r: Result<_, Error>, what: &str| match r {
        Err(Error::NotFound(w)) => assert_eq!(w, what),
        Err(e) => panic!("expected not found, got {e}"),
        Ok(_) => panic!("expected not found, got a value"),
    };
    nf(store.get_model("globex", m.id).await.map(|_| ()), "model");
    nf(
        store
            .get_model_by_name("globex", "proj", "agent")
            .await
            .map(|_| ()),
        "model",
    );
    nf(
        store
            .list_checkpoints("globex", m.id, None, 20, Order::Asc)
            .await
            .map(|_| ()),
        "model",
    );
    nf(
        store
            .delete_checkpoints("globex", m.id, &[0])
            .await
            .map(|_| ()),
        "model",
    );
    nf(
        store
            .log_metrics("globex", m.id, Default::default())
            .await
            .map(|_| ()),
        "model",
    );
    nf(
        store
            .enqueue_job("globex", m.id, temper_store::JobKind::Rl, "{}")
            .await
            .map(|_| ()),
        "model",
    );
    nf(
        store.get_job("globex", job.id).await.map(|_| ()),
        "training job",
    );
    nf(
        store
            .list_events("globex", job.id, None, 20)
            .await
            .map(|_| ()),
        "training job",
    );
    nf(
        store.cancel_job("globex", job.id).await.map(|_| ()),
        "training job",
    );
    nf(
        store.delete_model("globex", m.id).await.map(|_| ()),
        "model",
    );
    assert!(store.list_models("globex").await.unwrap().is_empty());
    assert!(store
        .list_jobs("globex", None, None, 20)
        .await
        .unwrap()
        .items
        .is_empty());

    // Nothing was touched: the owner still sees everything.
    assert_eq!(store.get_model("acme", m.id).await.unwrap(), m);
    assert_eq!(store.list_models("acme").await.unwrap(), vec![m.clone()]);
    assert_eq!(
        store.get_job("acme", job.id).await.unwrap().status,
        JobStatus::Queued
    );
}

async fn model_names_are_unique_per_team(db: Db) {
    let store = db.open().await;
    let m = model(&store, "acme", "agent").await;
    assert_eq!(m.team, "acme");
    assert_eq!(m.base_model, "gemma-3-270m");
    assert!(matches!(
        store
            .create_model(&NewModel {
                team: "acme",
                project: "proj",
                name: "agent",
                base_model: "other",
            })
            .await,
        Err(Error::ModelExists { .. })
    ));
    // Same name in another project or another team is another model.
    let other_team = model(&store, "globex", "agent").await;
    assert_ne!(other_team.id, m.id);
    let other_project = store
        .create_model(&NewModel {
            team: "acme",
            project: "proj2",
            name: "agent",
            base_model: "gemma-3-270m",
        })
        .await
        .unwrap();
    assert_ne!(other_project.id, m.id);
    assert_eq!(
        store
            .get_model_by_name("acme", "proj", "agent")
            .await
            .unwrap(),
        m
    );
    assert!(matches!(
        store
            .create_model(&NewModel {
                team: "acme",
                project: "proj",
                name: "a/b",
                base_model: "x",
            })
            .await,
        Err(Error::Invalid { field: "name", .. })
    ));
}

async fn checkpoint_pagination(db: Db) {
    let store = db.open().await;
    let m = model(&store, "acme", "agent").await;
    for step in 1..=5 {
        train(&store, &m, step).await;
    }
    let steps = |p: &temper_store::Page<temper_store::Checkpoint>| {
        p.items.iter().map(|c| c.step).collect::<Vec<_>>()
    };

    let p1 = store
        .list_checkpoints("acme", m.id, None, 2, Order::Asc)
        .await
        .unwrap();
    assert_eq!((steps(&p1), p1.has_more), (vec![0, 1], true));
    assert_eq!(p1.items[0].metrics, json!({}));
    assert_eq!(p1.items[1].metrics, json!({ "reward": 1 }));
    let p2 = store
        .list_checkpoints("acme", m.id, Some(p1.items[1].id), 2, Order::Asc)
        .await
        .unwrap();
    assert_eq!((steps(&p2), p2.has_more), (vec![2, 3], true));
    let p3 = store
        .list_checkpoints("acme", m.id, Some(p2.items[1].id), 2, Order::Asc)
        .await
        .unwrap();
    assert_eq!((steps(&p3), p3.has_more), (vec![4, 5], false));

    let d1 = store
        .list_checkpoints("acme", m.id, None, 4, Order::Desc)
        .await
        .unwrap();
    assert_eq!((steps(&d1), d1.has_more), (vec![5, 4, 3, 2], true));
    let d2 = store
        .list_checkpoints("acme", m.id, Some(d1.items[3].id), 4, Order::Desc)
        .await
        .unwrap();
    assert_eq!((steps(&d2), d2.has_more), (vec![1, 0], false));
    let all = store
        .list_checkpoints("acme", m.id, None, 100, Order::Asc)
        .await
        .unwrap();
    assert_eq!((steps(&all), all.has_more), (vec![0, 1, 2, 3, 4, 5], false));

    for bad in [0, 101] {
        assert!(matches!(
            store
                .list_checkpoints("acme", m.id, None, bad, Order::Asc)
                .await,
            Err(Error::Invalid { field: "limit", .. })
        ));
    }
    assert!(matches!(
        store
            .list_checkpoints("acme", m.id, Some(Uuid::new_v4()), 2, Order::Asc)
            .await,
        Err(Error::Invalid { field: "after", .. })
    ));
    assert_eq!("desc".parse::<Order>().unwrap(), Order::Desc);
    assert!("up".parse::<Order>().is_err());

    assert_eq!(
        store
            .latest_checkpoint("acme", m.id)
            .await
            .unwrap()
            .unwrap()
            .step,
        5
    );
    assert_eq!(
        store.get_checkpoint("acme", m.id, 3).await.unwrap().metrics,
        json!({ "reward": 3 })
    );
    // /log merges into the latest checkpoint.
    let mut metrics = serde_json::Map::new();
    metrics.insert("val/reward".into(), json!(0.5));
    let logged = store.log_metrics("acme", m.id, metrics).await.unwrap();
    assert_eq!(logged.step, 5);
    assert_eq!(
        store.get_checkpoint("acme", m.id, 5).await.unwrap().metrics,
        json!({ "reward": 5, "val/reward": 0.5 })
    );
}

async fn delete_checkpoints_reports_missing_steps(db: Db) {
    let store = db.open().await;
    let m = model(&store, "acme", "agent").await;
    for step in 1..=3 {
        train(&store, &m, step).await;
    }
    let r = store
        .delete_checkpoints("acme", m.id, &[1, 42, 3, 3])
        .await
        .unwrap();
    assert_eq!(r.deleted_count, 2);
    assert_eq!(r.not_found_steps, vec![42, 3]);
    let left = store
        .list_checkpoints("acme", m.id, None, 20, Order::Asc)
        .await
        .unwrap();
    assert_eq!(
        left.items.iter().map(|c| c.step).collect::<Vec<_>>(),
        vec![0, 2]
    );
    assert!(matches!(
        store.get_checkpoint("acme", m.id, 1).await,
        Err(Error::NotFound("checkpoint"))
    ));

    // Deleting the model removes what is left and fails its pending jobs.
    let queued = store
        .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();
    let d = store.delete_model("acme", m.id).await.unwrap();
    assert_eq!(d.deleted_checkpoints, 2);
    assert_eq!(d.failed_jobs, vec![queued.id]);
    let job = store.get_job("acme", queued.id).await.unwrap();
    assert_eq!(job.status, JobStatus::Failed);
    let events = store
        .list_events("acme", queued.id, None, 20)
        .await
        .unwrap();
    assert_eq!(events.items[0].kind, event::TRAINING_FAILED);
    assert!(matches!(
        store.get_model("acme", m.id).await,
        Err(Error::NotFound("model"))
    ));
    assert_eq!(store.claim_next_job(W, LEASE).await.unwrap(), None);
}

async fn jobs_run_in_order_per_model(db: Db) {
    let store = db.open().await;
    let a = model(&store, "acme", "a").await;
    let b = model(&store, "acme", "b").await;
    let a1 = store
        .enqueue_job("acme", a.id, temper_store::JobKind::Rl, "{\"n\": 1}")
        .await
        .unwrap();
    let a2 = store
        .enqueue_job("acme", a.id, temper_store::JobKind::Rl, "{\"n\": 2}")
        .await
        .unwrap();
    let b1 = store
        .enqueue_job("acme", b.id, temper_store::JobKind::Rl, "{\"n\": 3}")
        .await
        .unwrap();
    assert_eq!(a1.status, JobStatus::Queued);

    let first = store.claim_next_job(W, LEASE).await.unwrap().unwrap();
    assert_eq!(first.id, a1.id);
    assert_eq!(first.status, JobStatus::Running);
    assert!(first.started_at.is_some());
    // a2 waits for a1; b1 (another model) may run meanwhile.
    assert_eq!(
        store.claim_next_job(W, LEASE).await.unwrap().unwrap().id,
        b1.id
    );
    assert_eq!(store.claim_next_job(W, LEASE).await.unwrap(), None);
    let (done, ckpt) = store
        .succeed_job(a1.id, W, 1, Some(json!({})), &json!({ "step": 1 }))
        .await
        .unwrap();
    assert_eq!(done.status, JobStatus::Succeeded);
    assert_eq!(done.step, Some(1));
    assert!(done.finished_at.is_some());
    assert_eq!(ckpt.unwrap().step, 1);
    assert_eq!(
        store.claim_next_job(W, LEASE).await.unwrap().unwrap().id,
        a2.id
    );
    assert_eq!(store.job_request(a2.id).await.unwrap(), "{\"n\": 2}");

    // A step that already has a checkpoint is refused, and the job stays running.
    assert!(matches!(
        store
            .succeed_job(a2.id, W, 1, Some(json!({})), &json!({}))
            .await,
        Err(Error::CheckpointExists { step: 1, .. })
    ));
    assert_eq!(
        store.get_job("acme", a2.id).await.unwrap().status,
        JobStatus::Running
    );
    let failed = store.fail_job(a2.id, W, "out of memory").await.unwrap();
    assert_eq!(failed.status, JobStatus::Failed);
    assert_eq!(failed.error.as_deref(), Some("out of memory"));

    // Cancelling a running job: the worker's next write is refused.
    let cancelled = store.cancel_job("acme", b1.id).await.unwrap();
    assert_eq!(cancelled.status, JobStatus::Cancelled);
    assert!(matches!(
        store
            .append_event(b1.id, W, event::GRADIENT_STEP, &json!({}))
            .await,
        Err(Error::JobState {
            status: JobStatus::Cancelled,
            ..
        })
    ));
    assert!(matches!(
        store.succeed_job(b1.id, W, 1, None, &json!({})).await,
        Err(Error::JobState {
            status: JobStatus::Cancelled,
            ..
        })
    ));
    assert!(matches!(
        store.cancel_job("acme", a1.id).await,
        Err(Error::JobState {
            status: JobStatus::Succeeded,
            ..
        })
    ));
    assert!(matches!(
        store
            .enqueue_job("acme", a.id, temper_store::JobKind::Rl, "not json")
            .await,
        Err(Error::Invalid {
            field: "request",
            ..
        })
    ));

    let all = store.list_jobs("acme", None, None, 2).await.unwrap();
    assert_eq!(
        all.items.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![b1.id, a2.id]
    );
    assert!(all.has_more);
    let rest = store.list_jobs("acme", None, Some(a2.id), 2).await.unwrap();
    assert_eq!(
        rest.items.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![a1.id]
    );
    assert!(!rest.has_more);
    let of_b = store.list_jobs("acme", Some(b.id), None, 20).await.unwrap();
    assert_eq!(
        of_b.items.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![b1.id]
    );
}

async fn events_after_is_idempotent(db: Db) {
    let store = db.open().await;
    let m = model(&store, "acme", "agent").await;
    let job = store
        .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();
    // Not running yet: no events can be appended.
    assert!(matches!(
        store
            .append_event(job.id, W, event::TRAINING_STARTED, &json!({}))
            .await,
        Err(Error::JobState {
            status: JobStatus::Queued,
            ..
        })
    ));
    store.claim_next_job(W, LEASE).await.unwrap().unwrap();
    let started = store
        .append_event(
            job.id,
            W,
            event::TRAINING_STARTED,
            &json!({ "num_sequences": 2 }),
        )
        .await
        .unwrap();
    let s1 = store
        .append_event(
            job.id,
            W,
            event::GRADIENT_STEP,
            &json!({ "step": 1, "loss": 0.5 }),
        )
        .await
        .unwrap();
    assert!(s1.id > started.id);
    store
        .succeed_job(job.id, W, 1, Some(json!({})), &json!({ "step": 1 }))
        .await
        .unwrap();

    let first = store.list_events("acme", job.id, None, 2).await.unwrap();
    assert_eq!(
        first
            .items
            .iter()
            .map(|e| e.kind.as_str())
            .collect::<Vec<_>>(),
        vec![event::TRAINING_STARTED, event::GRADIENT_STEP]
    );
    assert!(first.has_more);
    assert_eq!(first.items[1].data, json!({ "step": 1, "loss": 0.5 }));
    let after = first.items[1].id;
    let again = store
        .list_events("acme", job.id, Some(after), 20)
        .await
        .unwrap();
    let twice = store
        .list_events("acme", job.id, Some(after), 20)
        .await
        .unwrap();
    assert_eq!(again, twice);
    assert_eq!(again.items.len(), 1);
    assert_eq!(again.items[0].kind, event::TRAINING_ENDED);
    assert!(!again.has_more);
    let none = store
        .list_events("acme", job.id, Some(again.items[0].id), 20)
        .await
        .unwrap();
    assert!(none.items.is_empty() && !none.has_more);
    assert_eq!(
        store
            .list_events("acme", job.id, None, 20)
            .await
            .unwrap()
            .items
            .len(),
        3
    );
}

async fn accepted_jobs_survive_a_crash_and_running_ones_are_requeued(db: Db) {
    let (model_id, running, queued) = {
        let store = db.open().await;
        let m = model(&store, "acme", "agent").await;
        let running = store
            .enqueue_job("acme", m.id, temper_store::JobKind::Rl, r#"{"n": 1}"#)
            .await
            .unwrap();
        let queued = store
            .enqueue_job("acme", m.id, temper_store::JobKind::Rl, r#"{"n": 2}"#)
            .await
            .unwrap();
        store.claim_next_job(W, LEASE).await.unwrap().unwrap();
        store
            .append_event(
                running.id,
                W,
                event::TRAINING_STARTED,
                &json!({ "num_sequences": 1 }),
            )
            .await
            .unwrap();
        // A crash: no close, no WAL checkpoint, connections never shut down.
        std::mem::forget(store);
        (m.id, running.id, queued.id)
    };

    let store = db.open().await;
    assert_eq!(
        store.get_job("acme", queued).await.unwrap().status,
        JobStatus::Queued
    );
    assert_eq!(store.job_request(queued).await.unwrap(), r#"{"n": 2}"#);
    assert_eq!(
        store.get_job("acme", running).await.unwrap().status,
        JobStatus::Running
    );
    assert_eq!(
        store.recover_after_crash(3).await.unwrap().requeued,
        vec![running]
    );
    let job = store.get_job("acme", running).await.unwrap();
    assert_eq!(job.status, JobStatus::Queued);
    assert_eq!(job.started_at, None);
    let events = store.list_events("acme", running, None, 20).await.unwrap();
    assert_eq!(
        events
            .items
            .iter()
            .map(|e| e.kind.as_str())
            .collect::<Vec<_>>(),
        vec![event::TRAINING_STARTED, event::TRAINING_REQUEUED]
    );
    // Nothing more to recover; the re-queued job runs first again, then the other.
    assert_eq!(
        store.recover_after_crash(3).await.unwrap(),
        temper_store::Recovery::default()
    );
    assert_eq!(
        store.claim_next_job(W, LEASE).await.unwrap().unwrap().id,
        running
    );
    store
        .succeed_job(running, W, 1, Some(json!({})), &json!({ "step": 1 }))
        .await
        .unwrap();
    assert_eq!(
        store.claim_next_job(W, LEASE).await.unwrap().unwrap().id,
        queued
    );
    assert_eq!(
        store.get_model("acme", model_id).await.unwrap().id,
        model_id
    );
    store.close().await;
}

async fn claims_count_attempts_and_a_job_running_at_max_attempts_crashes_fails(db: Db) {
    let (m, stuck, other) = {
        let store = db.open().await;
        let m = model(&store, "acme", "agent").await;
        let stuck = store
            .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
            .await
            .unwrap();
        assert_eq!(stuck.attempts, 0);
        let other = model(&store, "acme", "other").await;
        let other = store
            .enqueue_job("acme", other.id, temper_store::JobKind::Rl, "{}")
            .await
            .unwrap();
        store.close().await;
        (m, stuck.id, other.id)
    };
    // Three runs, each claiming the job and then crashing with it running.
    for attempt in 1..=3u32 {
        let store = db.open().await;
        let recovery = store.recover_after_crash(3).await.unwrap();
        if attempt == 1 {
            assert_eq!(recovery, temper_store::Recovery::default());
        } else {
            assert_eq!(recovery.requeued, vec![stuck], "start {attempt}");
            assert!(recovery.failed.is_empty());
        }
        let claimed = store.claim_next_job(W, LEASE).await.unwrap().unwrap();
        assert_eq!((claimed.id, claimed.attempts), (stuck, attempt));
        assert_eq!(
            store.get_job("acme", stuck).await.unwrap().attempts,
            attempt
        );
        std::mem::forget(store); // a crash
    }
    let store = db.open().await;
    let recovery = store.recover_after_crash(3).await.unwrap();
    assert_eq!(recovery.failed, vec![stuck]);
    assert!(recovery.requeued.is_empty());
    let job = store.get_job("acme", stuck).await.unwrap();
    assert_eq!(job.status, JobStatus::Failed);
    assert_eq!(job.attempts, 3);
    assert!(job.finished_at.is_some());
    let error = job.error.unwrap();
    assert!(
        error.contains("crashed or was killed 3 times in a row"),
        "{error}"
    );
    let events = store.list_events("acme", stuck, None, 20).await.unwrap();
    let kinds: Vec<&str> = events.items.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            event::TRAINING_REQUEUED,
            event::TRAINING_REQUEUED,
            event::TRAINING_FAILED
        ]
    );
    assert_eq!(events.items[0].data["attempts"], 1);
    assert_eq!(events.items[1].data["attempts"], 2);
    assert_eq!(events.items[2].data["error_message"], error.as_str());
    // Not re-queued: the next claim is another model's job, never the failed one.
    assert_eq!(
        store.claim_next_job(W, LEASE).await.unwrap().unwrap().id,
        other
    );
    assert!(store.claim_next_job(W, LEASE).await.unwrap().is_none());
    // A new job of the same model runs (the failed one no longer blocks its model).
    let next = store
        .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();
    assert_eq!(
        store.claim_next_job(W, LEASE).await.unwrap().unwrap().id,
        next.id
    );
    store.close().await;
}

async fn a_job_requeued_at_shutdown_gets_its_attempt_back(db: Db) {
    let store = db.open().await;
    let m = model(&store, "acme", "agent").await;
    let job = store
        .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();
    let queued = store
        .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();
    // Two graceful shutdowns in a row, then a crash: one crash attempt, so not failed at 2.
    for _ in 0..2 {
        assert_eq!(
            store
                .claim_next_job(W, LEASE)
                .await
                .unwrap()
                .unwrap()
                .attempts,
            1
        );
        assert_eq!(store.requeue_at_shutdown(W).await.unwrap(), vec![job.id]);
        let requeued = store.get_job("acme", job.id).await.unwrap();
        assert_eq!(
            (requeued.status, requeued.attempts, requeued.started_at),
            (JobStatus::Queued, 0, None)
        );
    }
    // Nothing running: nothing to re-queue, the queued job untouched.
    assert!(store.requeue_at_shutdown(W).await.unwrap().is_empty());
    assert_eq!(
        store.get_job("acme", queued.id).await.unwrap().status,
        JobStatus::Queued
    );
    assert_eq!(
        store.claim_next_job(W, LEASE).await.unwrap().unwrap().id,
        job.id
    );
    let recovery = store.recover_after_crash(2).await.unwrap();
    assert_eq!(recovery.requeued, vec![job.id]);
    let events = store.list_events("acme", job.id, None, 20).await.unwrap();
    let kinds: Vec<&str> = events.items.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            event::TRAINING_REQUEUED_AT_SHUTDOWN,
            event::TRAINING_REQUEUED_AT_SHUTDOWN,
            event::TRAINING_REQUEUED
        ]
    );
    assert_eq!(events.items[2].data["attempts"], 1);
    store.close().await;
}

async fn concurrent_claims_take_one_job_per_model(db: Db) {
    let store = db.open().await;
    let mut models = Vec::new();
    for name in ["a", "b", "c"] {
        let m = model(&store, "acme", name).await;
        for _ in 0..2 {
            store
                .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
                .await
                .unwrap();
        }
        models.push(m.id);
    }
    let claims: Vec<_> = (0..6)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.claim_next_job(W, LEASE).await.unwrap() })
        })
        .collect();
    let mut claimed = Vec::new();
    for c in claims {
        if let Some(job) = c.await.unwrap() {
            claimed.push(job.model_id);
        }
    }
    claimed.sort();
    models.sort();
    // One running job per model, never two of the same model nor the same job twice.
    assert_eq!(claimed, models);
}

/// Set in the child process of `a_killed_process_loses_no_accepted_job`: its store's location.
const CHILD_STORE: &str = "TEMPER_STORE_TEST_CHILD_STORE";

/// The child: accepts two jobs, starts one, reports their ids and waits to be killed.
#[tokio::test]
#[ignore = "run by a_killed_process_loses_no_accepted_job"]
async fn crash_child() {
    let Ok(store) = std::env::var(CHILD_STORE) else {
        return;
    };
    let location =
        StoreLocation::parse_url(&store).unwrap_or_else(|_| StoreLocation::Sqlite(store.into()));
    let store = Store::connect(&location).await.unwrap();
    let m = model(&store, "acme", "agent").await;
    let running = store
        .enqueue_job("acme", m.id, temper_store::JobKind::Rl, r#"{"n": 1}"#)
        .await
        .unwrap();
    let queued = store
        .enqueue_job("acme", m.id, temper_store::JobKind::Rl, r#"{"n": 2}"#)
        .await
        .unwrap();
    store.claim_next_job(W, LEASE).await.unwrap().unwrap();
    println!("JOBS {} {}", running.id, queued.id);
    tokio::time::sleep(std::time::Duration::from_secs(60)).await;
}

async fn a_killed_process_loses_no_accepted_job(db: Db) {
    use std::io::{BufRead, BufReader};
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["crash_child", "--exact", "--ignored", "--nocapture"])
        .env(CHILD_STORE, db.child_arg())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.starts_with("JOBS "))
            .expect("the child reports its jobs")
    })
    .await
    .unwrap();
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let ids: Vec<Uuid> = line[5..].split(' ').map(|s| s.parse().unwrap()).collect();

    let store = db.open().await;
    assert_eq!(
        store.recover_after_crash(3).await.unwrap().requeued,
        vec![ids[0]]
    );
    for id in &ids {
        assert_eq!(
            store.get_job("acme", *id).await.unwrap().status,
            JobStatus::Queued
        );
    }
    assert_eq!(store.job_request(ids[1]).await.unwrap(), r#"{"n": 2}"#);
    assert_eq!(
        store.claim_next_job(W, LEASE).await.unwrap().unwrap().id,
        ids[0]
    );
    store.close().await;
}

async fn jobs_keep_their_kind_and_request_across_a_reopen(db: Db) {
    let store = db.open().await;
    let m = model(&store, "acme", "m").await;
    let request = r#"{"trajectories": [{"messages": [], "metadata": {"scenario_id": "s1"}}]}"#;
    let sft = store
        .enqueue_job("acme", m.id, temper_store::JobKind::Sft, request)
        .await
        .unwrap();
    assert_eq!(sft.kind, temper_store::JobKind::Sft);
    store.close().await;
    let store = db.open().await;
    let job = store.get_job("acme", sft.id).await.unwrap();
    assert_eq!(job.kind, temper_store::JobKind::Sft);
    assert_eq!(store.job_request(sft.id).await.unwrap(), request);
}

async fn idempotency_keys_claim_replay_mismatch_and_release(db: Db) {
    use temper_store::{Claim, IdempotencyKey};
    let store = db.open().await;
    let key = IdempotencyKey {
        team: "acme",
        key: "k1",
        route: "POST /v1/preview/training-jobs",
    };
    assert_eq!(
        store.claim_idempotency(key, b"body").await.unwrap(),
        Claim::Claimed
    );
    // A second claim while the first is handled: in progress; another body: a mismatch.
    assert_eq!(
        store.claim_idempotency(key, b"body").await.unwrap(),
        Claim::InProgress
    );
    assert_eq!(
        store.claim_idempotency(key, b"other").await.unwrap(),
        Claim::Mismatch
    );
    // The same key on another route or of another team is another key.
    let other_route = IdempotencyKey {
        route: "POST /v1/preview/models",
        ..key
    };
    let other_team = IdempotencyKey {
        team: "globex",
        ..key
    };
    for k in [other_route, other_team] {
        assert_eq!(
            store.claim_idempotency(k, b"other").await.unwrap(),
            Claim::Claimed
        );
        store.release_idempotency(k).await.unwrap();
    }
    store
        .complete_idempotency(key, 200, br#"{"id": "x"}"#)
        .await
        .unwrap();
    let replay = Claim::Replay {
        status: 200,
        body: br#"{"id": "x"}"#.to_vec(),
    };
    assert_eq!(store.claim_idempotency(key, b"body").await.unwrap(), replay);
    // Answers survive a restart; a claim a crash left unanswered is released by the recovery.
    let pending = IdempotencyKey { key: "k2", ..key };
    assert_eq!(
        store.claim_idempotency(pending, b"body").await.unwrap(),
        Claim::Claimed
    );
    store.close().await;
    let store = db.open().await;
    store.recover_after_crash(3).await.unwrap();
    assert_eq!(store.claim_idempotency(key, b"body").await.unwrap(), replay);
    assert_eq!(
        store.claim_idempotency(pending, b"body").await.unwrap(),
        Claim::Claimed
    );
    // Released: the key can be claimed again.
    store.release_idempotency(pending).await.unwrap();
    assert_eq!(
        store.claim_idempotency(pending, b"new").await.unwrap(),
        Claim::Claimed
    );
}

async fn a_job_and_its_idempotent_answer_commit_together(db: Db) {
    use temper_store::{Claim, IdempotencyKey};
    let store = db.open().await;
    let m = model(&store, "acme", "m").await;
    let key = IdempotencyKey {
        team: "acme",
        key: "k",
        route: "POST /v1/preview/training-jobs",
    };
    assert_eq!(
        store.claim_idempotency(key, b"{}").await.unwrap(),
        Claim::Claimed
    );
    let job = store
        .enqueue_job_idempotent("acme", m.id, temper_store::JobKind::Rl, "{}", key)
        .await
        .unwrap();
    // Answered with the job even if the server dies before the handler answers: the start-up
    // recovery keeps it, and a later completion does not overwrite it.
    store.recover_after_crash(3).await.unwrap();
    store
        .complete_idempotency(key, 500, b"other")
        .await
        .unwrap();
    let body = format!(r#"{{"id":"{}"}}"#, job.id).into_bytes();
    assert_eq!(
        store.claim_idempotency(key, b"{}").await.unwrap(),
        Claim::Replay { status: 200, body }
    );
}

async fn a_team_past_its_queued_job_limit_is_refused_and_others_are_not(db: Db) {
    let store = db.open().await.with_max_queued_jobs_per_team(2);
    let a = model(&store, "a", "m").await;
    let b = model(&store, "b", "m").await;
    let post = |m: &Model| {
        let (store, team, id) = (store.clone(), m.team.clone(), m.id);
        async move {
            store
                .enqueue_job(&team, id, temper_store::JobKind::Rl, "{}")
                .await
        }
    };
    post(&a).await.unwrap();
    post(&a).await.unwrap();
    match post(&a).await {
        Err(Error::TeamQueueFull { team, limit }) => assert_eq!((team.as_str(), limit), ("a", 2)),
        other => panic!("expected TeamQueueFull, got {other:?}"),
    }
    // Another team's queue is its own; a missing model is still a 404, not a full queue.
    post(&b).await.unwrap();
    let missing = store
        .enqueue_job("a", Uuid::new_v4(), temper_store::JobKind::Rl, "{}")
        .await;
    assert!(
        matches!(missing, Err(Error::NotFound("model"))),
        "{missing:?}"
    );
    // A started job leaves the queue: the team may post again.
    store
        .claim_next_job(W, LEASE)
        .await
        .unwrap()
        .expect("a queued job");
    post(&a).await.unwrap();
}

async fn concurrent_posts_never_pass_the_team_queue_limit(db: Db) {
    let store = db.open().await.with_max_queued_jobs_per_team(3);
    let m = model(&store, "acme", "m").await;
    let posts: Vec<_> = (0..12)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
                    .await
            })
        })
        .collect();
    let mut accepted = 0;
    for post in posts {
        match post.await.unwrap() {
            Ok(_) => accepted += 1,
            Err(Error::TeamQueueFull { limit: 3, .. }) => {}
            Err(e) => panic!("expected TeamQueueFull, got {e}"),
        }
    }
    assert_eq!(accepted, 3);
    let queued = store.list_jobs("acme", None, None, 100).await.unwrap();
    assert_eq!(queued.items.len(), 3);
}

/// Eight workers on two stores (two servers' pools) drain a queue of six models' jobs, all
/// claiming at once: no job is claimed twice, no model ever has two jobs running, and each
/// model's jobs run in the order they were queued.
async fn workers_on_separate_connections_never_share_a_job_nor_a_model(db: Db) {
    let stores = [db.open().await, db.open().await];
    let mut models = Vec::new();
    for name in ["a", "b", "c", "d", "e", "f"] {
        models.push(model(&stores[0], "acme", name).await);
    }
    let mut queued: HashMap<Uuid, Vec<Uuid>> = HashMap::new();
    for _ in 0..5 {
        for m in &models {
            let job = stores[1]
                .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
                .await
                .unwrap();
            queued.entry(m.id).or_default().push(job.id);
        }
    }
    let total = queued.values().map(Vec::len).sum::<usize>();
    let running_models = Arc::new(Mutex::new(HashSet::new()));
    let claimed: Arc<Mutex<HashMap<Uuid, Vec<Uuid>>>> = Arc::default();
    let start = Arc::new(tokio::sync::Barrier::new(8));
    let workers: Vec<_> = (0..8)
        .map(|i| {
            let store = stores[i % 2].clone();
            let (running_models, claimed, start) =
                (running_models.clone(), claimed.clone(), start.clone());
            tokio::spawn(async move {
                let worker = format!("worker-{i}");
                start.wait().await;
                loop {
                    let Some(job) = store.claim_next_job(&worker, LEASE).await.unwrap() else {
                        let done = claimed
                            .lock()
                            .unwrap()
                            .values()
                            .map(Vec::len)
                            .sum::<usize>();
                        if done >= total {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        continue;
                    };
                    assert_eq!(job.lease_owner.as_deref(), Some(worker.as_str()));
                    assert!(
                        running_models.lock().unwrap().insert(job.model_id),
                        "two running jobs of model {}",
                        job.model_id
                    );
                    claimed
                        .lock()
                        .unwrap()
                        .entry(job.model_id)
                        .or_default()
                        .push(job.id);
                    store
                        .append_event(job.id, &worker, event::TRAINING_STARTED, &json!({}))
                        .await
                        .unwrap();
                    // Out of the set before the job ends: the next one may start right after.
                    running_models.lock().unwrap().remove(&job.model_id);
                    store
                        .succeed_job(job.id, &worker, 0, None, &json!({ "step": 0 }))
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    let drained = tokio::time::timeout(Duration::from_secs(60), async {
        for worker in workers {
            worker.await.unwrap();
        }
    })
    .await;
    assert!(drained.is_ok(), "the workers did not drain the queue");
    let claimed = claimed.lock().unwrap().clone();
    assert_eq!(claimed, queued, "each model's jobs, once each, in order");
    for id in queued.values().flatten() {
        let job = stores[0].get_job("acme", *id).await.unwrap();
        assert_eq!((job.status, job.attempts), (JobStatus::Succeeded, 1));
    }
}

async fn an_expired_lease_requeues_the_job_with_an_event_and_another_worker_finishes_it(db: Db) {
    let (a, b) = (db.open().await, db.open().await);
    let m = model(&a, "acme", "agent").await;
    let job = a
        .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();
    // A lease of zero has ended by the time anyone looks.
    let claimed = a
        .claim_next_job("worker-a", Duration::ZERO)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claimed.id, job.id);
    assert_eq!(claimed.lease_owner.as_deref(), Some("worker-a"));
    assert!(claimed.lease_expires_at.is_some());
    // Until another worker re-queues it, it is still worker-a's.
    a.append_event(job.id, "worker-a", event::TRAINING_STARTED, &json!({}))
        .await
        .unwrap();

    let recovery = b.requeue_expired_leases(3).await.unwrap();
    assert_eq!(recovery.requeued, vec![job.id]);
    assert!(recovery.failed.is_empty());
    assert_eq!(
        b.requeue_expired_leases(3).await.unwrap(),
        temper_store::Recovery::default()
    );
    let requeued = b.get_job("acme", job.id).await.unwrap();
    assert_eq!(
        (
            requeued.status,
            requeued.attempts,
            requeued.started_at,
            requeued.lease_owner.clone(),
            requeued.lease_expires_at
        ),
        (JobStatus::Queued, 1, None, None, None)
    );
    let events = b.list_events("acme", job.id, None, 20).await.unwrap();
    assert_eq!(events.items.len(), 2);
    let event = &events.items[1];
    assert_eq!(event.kind, event::TRAINING_REQUEUED);
    assert_eq!(event.data["worker"], "worker-a");
    assert_eq!(event.data["attempts"], 1);
    let message = event.data["message"].as_str().unwrap();
    assert!(message.contains("lease of worker worker-a"), "{message}");

    // worker-a lost it: while it is queued every write of worker-a is refused...
    let queued = |r: Result<(), Error>| match r {
        Err(Error::JobState {
            status: JobStatus::Queued,
            ..
        }) => {}
        other => panic!("expected JobState queued, got {other:?}"),
    };
    queued(
        a.append_event(job.id, "worker-a", event::GRADIENT_STEP, &json!({}))
            .await
            .map(drop),
    );
    queued(
        a.succeed_job(job.id, "worker-a", 1, Some(json!({})), &json!({}))
            .await
            .map(drop),
    );
    queued(a.fail_job(job.id, "worker-a", "x").await.map(drop));
    queued(a.renew_lease(job.id, "worker-a", LEASE).await);

    // ... and while worker-b runs it, too.
    let rerun = b.claim_next_job("worker-b", LEASE).await.unwrap().unwrap();
    assert_eq!((rerun.id, rerun.attempts), (job.id, 2));
    assert_eq!(rerun.lease_owner.as_deref(), Some("worker-b"));
    let lost = |r: Result<(), Error>| match r {
        Err(Error::LeaseLost { id, worker }) => {
            assert_eq!((id, worker.as_str()), (job.id, "worker-a"))
        }
        other => panic!("expected LeaseLost, got {other:?}"),
    };
    lost(
        a.append_event(job.id, "worker-a", event::GRADIENT_STEP, &json!({}))
            .await
            .map(drop),
    );
    lost(
        a.succeed_job(job.id, "worker-a", 1, Some(json!({})), &json!({}))
            .await
            .map(drop),
    );
    lost(a.fail_job(job.id, "worker-a", "x").await.map(drop));
    lost(a.renew_lease(job.id, "worker-a", LEASE).await);
    assert!(a.requeue_at_shutdown("worker-a").await.unwrap().is_empty());
    assert!(a
        .requeue_expired_leases(3)
        .await
        .unwrap()
        .requeued
        .is_empty());

    b.append_event(job.id, "worker-b", event::TRAINING_STARTED, &json!({}))
        .await
        .unwrap();
    let (done, checkpoint) = b
        .succeed_job(
            job.id,
            "worker-b",
            1,
            Some(json!({})),
            &json!({ "step": 1 }),
        )
        .await
        .unwrap();
    assert_eq!(done.status, JobStatus::Succeeded);
    assert_eq!(checkpoint.unwrap().step, 1);
    assert!(matches!(
        a.fail_job(job.id, "worker-a", "late").await,
        Err(Error::JobState {
            status: JobStatus::Succeeded,
            ..
        })
    ));
    let kinds: Vec<String> = a
        .list_events("acme", job.id, None, 20)
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds,
        [
            event::TRAINING_STARTED,
            event::TRAINING_REQUEUED,
            event::TRAINING_STARTED,
            event::TRAINING_ENDED
        ]
    );
    let job = a.get_job("acme", job.id).await.unwrap();
    assert_eq!((job.lease_owner, job.lease_expires_at), (None, None));
}

async fn a_renewed_lease_keeps_its_job(db: Db) {
    let store = db.open().await;
    let m = model(&store, "acme", "agent").await;
    let job = store
        .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();
    assert!(matches!(
        store.renew_lease(job.id, W, LEASE).await,
        Err(Error::JobState {
            status: JobStatus::Queued,
            ..
        })
    ));
    store.claim_next_job(W, Duration::ZERO).await.unwrap();
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    store.renew_lease(job.id, W, LEASE).await.unwrap();
    assert!(store
        .requeue_expired_leases(3)
        .await
        .unwrap()
        .requeued
        .is_empty());
    let running = store.get_job("acme", job.id).await.unwrap();
    assert_eq!(running.status, JobStatus::Running);
    assert!(running.lease_expires_at.unwrap() >= before + LEASE.as_secs() as i64);
    // Only the holder renews.
    assert!(matches!(
        store.renew_lease(job.id, "worker-2", LEASE).await,
        Err(Error::LeaseLost { .. })
    ));
    // A cancelled job's worker learns it at its next renewal.
    store.cancel_job("acme", job.id).await.unwrap();
    assert!(matches!(
        store.renew_lease(job.id, W, LEASE).await,
        Err(Error::JobState {
            status: JobStatus::Cancelled,
            ..
        })
    ));
    assert!(matches!(
        store.renew_lease(Uuid::new_v4(), W, LEASE).await,
        Err(Error::NotFound("training job"))
    ));
}

async fn jobs_whose_worker_is_lost_at_max_attempts_fail(db: Db) {
    let store = db.open().await;
    let m = model(&store, "acme", "agent").await;
    let job = store
        .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();
    for attempt in 1..=3u32 {
        let worker = format!("worker-{attempt}");
        let claimed = store
            .claim_next_job(&worker, Duration::ZERO)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((claimed.id, claimed.attempts), (job.id, attempt));
        let recovery = store.requeue_expired_leases(3).await.unwrap();
        if attempt < 3 {
            assert_eq!(recovery.requeued, vec![job.id]);
        } else {
            assert_eq!(recovery.failed, vec![job.id]);
            assert!(recovery.requeued.is_empty());
        }
    }
    let failed = store.get_job("acme", job.id).await.unwrap();
    assert_eq!(failed.status, JobStatus::Failed);
    assert_eq!(failed.attempts, 3);
    assert!(failed.finished_at.is_some());
    assert_eq!(failed.lease_owner, None);
    let error = failed.error.unwrap();
    assert!(
        error.contains("3 times in a row") && error.contains("lease of worker worker-3"),
        "{error}"
    );
    let events = store.list_events("acme", job.id, None, 20).await.unwrap();
    let kinds: Vec<&str> = events.items.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            event::TRAINING_REQUEUED,
            event::TRAINING_REQUEUED,
            event::TRAINING_FAILED
        ]
    );
    assert_eq!(events.items[1].data["worker"], "worker-2");
    assert_eq!(events.items[2].data["error_message"], error.as_str());
    assert_eq!(store.claim_next_job(W, LEASE).await.unwrap(), None);
}

async fn shutdown_requeues_only_the_workers_own_jobs(db: Db) {
    let store = db.open().await;
    let a = model(&store, "acme", "a").await;
    let b = model(&store, "acme", "b").await;
    let a1 = store
        .enqueue_job("acme", a.id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();
    let b1 = store
        .enqueue_job("acme", b.id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();
    assert_eq!(
        store
            .claim_next_job("worker-a", LEASE)
            .await
            .unwrap()
            .unwrap()
            .id,
        a1.id
    );
    assert_eq!(
        store
            .claim_next_job("worker-b", LEASE)
            .await
            .unwrap()
            .unwrap()
            .id,
        b1.id
    );
    assert_eq!(
        store.requeue_at_shutdown("worker-a").await.unwrap(),
        vec![a1.id]
    );
    let a1 = store.get_job("acme", a1.id).await.unwrap();
    assert_eq!((a1.status, a1.attempts), (JobStatus::Queued, 0));
    let b1 = store.get_job("acme", b1.id).await.unwrap();
    assert_eq!(b1.status, JobStatus::Running);
    assert_eq!(b1.lease_owner.as_deref(), Some("worker-b"));
    store
        .append_event(b1.id, "worker-b", event::TRAINING_STARTED, &json!({}))
        .await
        .unwrap();
}

async fn stale_idempotency_claims_are_released(db: Db) {
    use temper_store::{Claim, IdempotencyKey};
    let store = db.open().await;
    let key = IdempotencyKey {
        team: "acme",
        key: "k",
        route: "POST /v1/preview/training-jobs",
    };
    let answered = IdempotencyKey { key: "done", ..key };
    for k in [key, answered] {
        assert_eq!(
            store.claim_idempotency(k, b"{}").await.unwrap(),
            Claim::Claimed
        );
    }
    store
        .complete_idempotency(answered, 200, b"answer")
        .await
        .unwrap();
    let hour = Duration::from_secs(3600);
    assert_eq!(
        store.release_stale_idempotency_claims(hour).await.unwrap(),
        0
    );
    assert_eq!(
        store.claim_idempotency(key, b"{}").await.unwrap(),
        Claim::InProgress
    );
    // Only the unanswered claim goes; the answer stays for retries.
    assert_eq!(
        store
            .release_stale_idempotency_claims(Duration::ZERO)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        store.claim_idempotency(key, b"{}").await.unwrap(),
        Claim::Claimed
    );
    assert_eq!(
        store.claim_idempotency(answered, b"{}").await.unwrap(),
        Claim::Replay {
            status: 200,
            body: b"answer".to_vec()
        }
    );
}

async fn training_totals_count_jobs_steps_and_tokens(db: Db) {
    let store = db.open().await;
    assert_eq!(
        store.training_totals().await.unwrap(),
        temper_store::TrainingTotals::default()
    );
    let m = model(&store, "acme", "agent").await;
    let job = store
        .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();
    store
        .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();
    store.claim_next_job(W, LEASE).await.unwrap().unwrap();
    for tokens in [10, 15] {
        store
            .append_event(
                job.id,
                W,
                event::GRADIENT_STEP,
                &json!({ "loss": 0.5, "num_trainable_tokens": tokens }),
            )
            .await
            .unwrap();
    }
    store
        .succeed_job(job.id, W, 1, Some(json!({})), &json!({ "step": 1 }))
        .await
        .unwrap();
    let totals = store.training_totals().await.unwrap();
    assert_eq!(
        totals.jobs_by_status,
        vec![("queued".to_owned(), 1), ("succeeded".to_owned(), 1)]
    );
    assert_eq!(totals.succeeded_jobs, 1);
    assert!(totals.succeeded_job_seconds <= 5, "{totals:?}");
    assert_eq!((totals.gradient_steps, totals.trained_tokens), (2, 25));
}

/// PostgreSQL only (SQLite has no row locks: its claims take turns). A job another worker is
/// claiming (its row locked) is skipped without waiting, and its model's later jobs stay behind
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_skips_a_job_being_claimed_but_not_to_its_later_jobs() {
    let Some(db) = Db::postgres().await else {
        return;
    };
    let store = db.open().await;
    let a = model(&store, "acme", "a").await;
    let b = model(&store, "acme", "b").await;
    let mut jobs = Vec::new();
    for m in [&a, &a, &b] {
        jobs.push(
            store
                .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
                .await
                .unwrap()
                .id,
        );
    }
    let StoreLocation::Postgres(url) = &db.location else {
        unreachable!()
    };
    let mut other = sqlx::PgConnection::connect(url).await.unwrap();
    let mut claiming = other.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM training_jobs WHERE id = $1 FOR UPDATE")
        .bind(jobs[0].to_string())
        .execute(&mut *claiming)
        .await
        .unwrap();
    let claim = || tokio::time::timeout(Duration::from_secs(10), store.claim_next_job(W, LEASE));
    let first = claim().await.expect("a claim never waits").unwrap();
    assert_eq!(first.map(|j| j.id), Some(jobs[2]));
    assert_eq!(claim().await.expect("a claim never waits").unwrap(), None);
    claiming.rollback().await.unwrap();
    assert_eq!(claim().await.unwrap().unwrap().map(|j| j.id), Some(jobs[0]));
}

/// A model deleted while jobs are posted for it and its running job ends: every job of it ends
/// failed or succeeded (none left queued or running), and nothing deadlocks.
async fn a_model_deleted_amid_posts_and_a_finishing_job_leaves_none_pending(db: Db) {
    let store = db.open().await;
    for round in 0..6 {
        let m = model(&store, "acme", &format!("m{round}")).await;
        let running = store
            .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
            .await
            .unwrap();
        assert_eq!(
            store.claim_next_job(W, LEASE).await.unwrap().unwrap().id,
            running.id
        );
        let mut tasks = Vec::new();
        for _ in 0..6 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                match store
                    .enqueue_job("acme", m.id, temper_store::JobKind::Rl, "{}")
                    .await
                {
                    Ok(_) | Err(Error::NotFound("model")) => {}
                    Err(e) => panic!("posting: {e}"),
                }
            }));
        }
        let finishing = store.clone();
        tasks.push(tokio::spawn(async move {
            match finishing
                .succeed_job(running.id, W, 1, Some(json!({})), &json!({ "step": 1 }))
                .await
            {
                Ok(_)
                | Err(Error::JobState {
                    status: JobStatus::Failed,
                    ..
                })
                | Err(Error::NotFound("model")) => {}
                Err(e) => panic!("finishing: {e}"),
            }
        }));
        let deleting = store.clone();
        tasks.push(tokio::spawn(async move {
            deleting.delete_model("acme", m.id).await.unwrap();
        }));
        for task in tasks {
            task.await.unwrap();
        }
        let jobs = store
            .list_jobs("acme", Some(m.id), None, 100)
            .await
            .unwrap();
        for job in &jobs.items {
            assert!(
                matches!(job.status, JobStatus::Failed | JobStatus::Succeeded),
                "round {round}: job {} is {}",
                job.id,
                job.status
            );
        }
    }
}

async fn an_import_takes_the_next_step_and_holds_the_model_until_it_commits(db: Db) {
    use temper_store::IdempotencyKey;
    let store = db.open().await;
    let m = model(&store, "acme", "m").await;
    assert!(matches!(
        store.begin_checkpoint_import("other", m.id).await,
        Err(Error::NotFound(_))
    ));
    // The next step; dropped, nothing is written and the step is free again.
    let import = store.begin_checkpoint_import("acme", m.id).await.unwrap();
    assert_eq!(import.step, 1);
    drop(import);
    let key = IdempotencyKey {
        team: "acme",
        key: "import",
        route: "POST /v1/preview/models/x/checkpoints",
    };
    store.claim_idempotency(key, b"tar").await.unwrap();
    let import = store.begin_checkpoint_import("acme", m.id).await.unwrap();
    assert_eq!(import.step, 1);
    let answer = |c: &temper_store::Checkpoint| format!("step {}", c.step).into_bytes();
    let checkpoint = import
        .commit(&json!({"imported": true}), Some((key, &answer)))
        .await
        .unwrap();
    assert_eq!(
        (checkpoint.step, &checkpoint.metrics),
        (1, &json!({"imported": true}))
    );
    assert_eq!(
        store.claim_idempotency(key, b"tar").await.unwrap(),
        temper_store::Claim::Replay {
            status: 200,
            body: b"step 1".to_vec()
        }
    );
    train(&store, &m, 2).await;

    // A job queued while an import is open waits for it, then trains from the imported step.
    let import = store.begin_checkpoint_import("acme", m.id).await.unwrap();
    assert_eq!(import.step, 3);
    let queue = {
        let store = store.clone();
        let id = m.id;
        tokio::spawn(async move {
            store
                .enqueue_job("acme", id, temper_store::JobKind::Rl, "{}")
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!queue.is_finished(), "a job was queued past an open import");
    import.commit(&json!({}), None).await.unwrap();
    queue.await.unwrap().unwrap();
    let latest = store
        .latest_checkpoint("acme", m.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(latest.step, 3);
    // With that job queued (and then running), an import is refused: the job makes step 4.
    assert!(matches!(
        store.begin_checkpoint_import("acme", m.id).await,
        Err(Error::ModelBusy { .. })
    ));
    store
        .claim_next_job(W, LEASE)
        .await
        .unwrap()
        .expect("the job");
    assert!(matches!(
        store.begin_checkpoint_import("acme", m.id).await,
        Err(Error::ModelBusy { .. })
    ));
}
