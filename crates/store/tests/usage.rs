//! Token usage and quotas on both backends (see `common`: `<test>::sqlite`, `<test>::postgres`).

mod common;

use std::time::Duration;

use common::{on_both_backends, Db};

use serde_json::json;
use temper_store::{
    event, usage_bucket, utc_month, Error, JobKind, NewModel, Quota, TokenCounts, UsageKey,
    UsageRow,
};

/// The worker of the tests that run jobs.
const W: &str = "worker-1";
const LEASE: Duration = Duration::from_secs(600);

on_both_backends!(
    concurrent_adds_are_all_counted_once,
    rows_are_the_teams_own_in_the_range,
    gradient_steps_count_their_trainable_tokens_for_the_models_project,
    quotas_count_this_months_prompt_completion_and_trained_tokens
);

fn key(team: &str, project: &str, model: &str, bucket_start: i64) -> UsageKey {
    UsageKey {
        team: team.into(),
        project: project.into(),
        model: model.into(),
        bucket_start,
    }
}

fn chat(input: u64, output: u64) -> TokenCounts {
    TokenCounts {
        input_tokens: input,
        cached_input_tokens: input / 2,
        output_tokens: output,
        num_model_requests: 1,
        ..TokenCounts::default()
    }
}

async fn concurrent_adds_are_all_counted_once(db: Db) {
    let store = db.open().await;
    let hour = usage_bucket(1_700_000_000);
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                for _ in 0..25 {
                    let batch = [
                        (key("a", "p", "m", hour), chat(3, 2)),
                        (key("a", "q", "m", hour), chat(1, 1)),
                    ];
                    store.add_usage(&batch).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let rows = store.usage_rows("a", hour, hour + 3600).await.unwrap();
    let expected = |input, cached, output| TokenCounts {
        input_tokens: input,
        cached_input_tokens: cached,
        output_tokens: output,
        num_model_requests: 200,
        ..TokenCounts::default()
    };
    assert_eq!(
        rows,
        [
            UsageRow {
                bucket_start: hour,
                project: "p".into(),
                model: "m".into(),
                counts: expected(600, 200, 400),
            },
            UsageRow {
                bucket_start: hour,
                project: "q".into(),
                model: "m".into(),
                counts: expected(200, 0, 200),
            },
        ]
    );
}

async fn rows_are_the_teams_own_in_the_range(db: Db) {
    let store = db.open().await;
    let h = usage_bucket(1_700_000_000);
    store
        .add_usage(&[
            (key("a", "p", "m", h - 3600), chat(1, 1)),
            (key("a", "p", "m", h), chat(2, 2)),
            (key("a", "p", "n", h + 3600), chat(3, 3)),
            (key("b", "p", "m", h), chat(4, 4)),
        ])
        .await
        .unwrap();
    let rows = store.usage_rows("a", h, h + 7200).await.unwrap();
    let seen: Vec<(i64, &str, u64)> = rows
        .iter()
        .map(|r| (r.bucket_start, r.model.as_str(), r.counts.input_tokens))
        .collect();
    assert_eq!(seen, [(h, "m", 2), (h + 3600, "n", 3)]);
    assert!(store.usage_rows("c", 0, i64::MAX).await.unwrap().is_empty());
}

async fn gradient_steps_count_their_trainable_tokens_for_the_models_project(db: Db) {
    let store = db.open().await;
    let model = store
        .create_model(&NewModel {
            team: "a",
            project: "research",
            name: "agent",
            base_model: "base",
        })
        .await
        .unwrap();
    let job = store
        .enqueue_job("a", model.id, JobKind::Rl, "{}")
        .await
        .unwrap();
    store.claim_next_job(W, LEASE).await.unwrap().unwrap();
    for tokens in [7, 5] {
        store
            .append_event(
                job.id,
                W,
                event::GRADIENT_STEP,
                &json!({"step": 1, "loss": 0.5, "num_trainable_tokens": tokens}),
            )
            .await
            .unwrap();
    }
    // Other events count nothing.
    store
        .append_event(
            job.id,
            W,
            event::TRAINING_STARTED,
            &json!({"num_sequences": 2}),
        )
        .await
        .unwrap();
    store.cancel_job("a", job.id).await.unwrap();
    // A step refused because the job no longer runs is not counted either.
    let refused = store
        .append_event(
            job.id,
            W,
            event::GRADIENT_STEP,
            &json!({"num_trainable_tokens": 100}),
        )
        .await
        .unwrap_err();
    assert!(matches!(refused, Error::JobState { .. }), "{refused}");
    let rows = store.usage_rows("a", 0, i64::MAX).await.unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].project, "research");
    assert_eq!(rows[0].model, "a/research/agent");
    assert_eq!(
        rows[0].counts,
        TokenCounts {
            trained_tokens: 12,
            num_gradient_steps: 2,
            ..TokenCounts::default()
        }
    );
}

async fn quotas_count_this_months_prompt_completion_and_trained_tokens(db: Db) {
    let store = db.open().await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let (month, next) = utc_month(now);
    assert!(store.quota("a", now).await.unwrap().is_none());
    assert!(!store.set_quota("a", Some(100)).await.unwrap());
    let trained = TokenCounts {
        trained_tokens: 30,
        num_gradient_steps: 1,
        ..TokenCounts::default()
    };
    store
        .add_usage(&[
            (key("a", "p", "m", month), chat(10, 5)),
            (key("a", "q", "m", next - 3600), trained),
            // The month before, the next one and another team do not count.
            (key("a", "p", "m", month - 3600), chat(1000, 0)),
            (key("a", "p", "m", next), chat(1000, 0)),
            (key("b", "p", "m", month), chat(1000, 0)),
        ])
        .await
        .unwrap();
    let quota = Quota {
        team: "a".into(),
        monthly_tokens: 100,
        used_tokens: 45,
        period_start: month,
        period_end: next,
    };
    assert_eq!(store.quota("a", now).await.unwrap(), Some(quota.clone()));
    assert!(!quota.is_exceeded());
    // Setting again replaces the quota.
    assert!(store.set_quota("a", Some(45)).await.unwrap());
    let lowered = store.quota("a", now).await.unwrap().unwrap();
    assert!(lowered.is_exceeded(), "{lowered:?}");
    store.set_quota("b", Some(0)).await.unwrap();
    let all: Vec<(String, u64, u64)> = store
        .list_quotas(now)
        .await
        .unwrap()
        .into_iter()
        .map(|q| (q.team, q.monthly_tokens, q.used_tokens))
        .collect();
    assert_eq!(all, [("a".into(), 45, 45), ("b".into(), 0, 1000)]);
    assert!(store.set_quota("a", None).await.unwrap());
    assert!(store.quota("a", now).await.unwrap().is_none());
    assert!(!store.set_quota("a", None).await.unwrap());
    // Quotas are kept across a reopen, and bad team names are refused.
    drop(store);
    let store = db.open().await;
    assert_eq!(store.list_quotas(now).await.unwrap().len(), 1);
    let bad = store.set_quota("no spaces", Some(1)).await.unwrap_err();
    assert!(matches!(bad, Error::Invalid { field: "team", .. }), "{bad}");
}
