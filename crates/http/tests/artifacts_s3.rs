//! Training with `--artifacts s3://...` against a real S3-compatible server (moto, under
//! `scripts/with-s3.sh`; without it these skip, or fail with `TEMPER_REQUIRE_S3=1`): checkpoints
//! whose adapters exist only in the bucket are trained on and served by a second server sharing
//! the store, deleted with their objects; and a job whose adapter cannot be stored fails
//! without a checkpoint.

mod common;
#[path = "../../store/tests/s3/mod.rs"]
mod s3;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{options, TestServer};
use serde_json::{json, Value};
use temper_http::{Catalog, CatalogOptions, TrainingOptions};
use temper_store::{ArtifactError, Artifacts, ArtifactsLocation};
use uuid::Uuid;

fn catalog_options(data: &Path, artifacts: &ArtifactsLocation) -> CatalogOptions {
    let mut catalog = CatalogOptions::new(data);
    catalog.artifacts = artifacts.clone();
    catalog
}

/// A server over the store in `data` with its adapters in `artifacts`; with the job worker
/// when `worker`.
async fn server(data: &Path, artifacts: &ArtifactsLocation, worker: bool) -> TestServer {
    let server = TestServer::tiny_training(
        options(),
        catalog_options(data, artifacts),
        TrainingOptions::default(),
        None,
    )
    .await;
    if worker {
        server.state.training().unwrap().spawn_worker().unwrap();
    }
    server
}

async fn get(server: &TestServer, path: &str) -> Value {
    let resp = server.get(path).await;
    let status = resp.status().as_u16();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(status, 200, "GET {path}: {v}");
    v
}

async fn create_model(server: &TestServer) -> Uuid {
    let body = json!({"project": "proj", "name": "m", "base_model": "tiny"});
    server.post_ok("/v1/preview/models", &body).await["id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// Runs one SFT job on the model to its end; the job's JSON.
async fn sft(server: &TestServer, model_id: Uuid) -> Value {
    let line = |q: &str, a: &str| json!({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]});
    let job = server
        .post_ok(
            "/v1/preview/sft-training-jobs",
            &json!({"model_id": model_id.to_string(), "trajectories": [line("hi", "hello"), line("bye", "ciao")],
                    "config": {"learning_rate": 1e-2}}),
        )
        .await;
    let id = job["id"].as_str().unwrap();
    let start = Instant::now();
    loop {
        let j = get(server, &format!("/v1/preview/training-jobs/{id}")).await;
        if ["succeeded", "failed", "cancelled"].contains(&j["status"].as_str().unwrap()) {
            return j;
        }
        assert!(start.elapsed() < Duration::from_secs(300), "job {id}: {j}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn steps(server: &TestServer, model_id: Uuid) -> Vec<i64> {
    get(
        server,
        &format!("/v1/preview/models/{model_id}/checkpoints"),
    )
    .await["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["step"].as_i64().unwrap())
        .collect()
}

/// The greedy first token's logprob for `model` (a name the server resolves).
async fn first_logprob(server: &TestServer, model: &str) -> f64 {
    let out = server
        .post_ok(
            "/v1/chat/completions",
            &json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1, "temperature": 0.0, "logprobs": true}),
        )
        .await;
    out["choices"][0]["logprobs"]["content"][0]["logprob"]
        .as_f64()
        .unwrap_or_else(|| panic!("{out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_in_s3_are_served_by_another_server_and_deleted_with_their_objects() {
    let test = "checkpoints_in_s3_are_served_by_another_server_and_deleted_with_their_objects";
    let Some(endpoint) = s3::endpoint(test) else {
        return;
    };
    let bucket = s3::Bucket::create(&endpoint).await;
    let location: ArtifactsLocation = bucket.url("adapters").parse().unwrap();
    let data = tempfile::tempdir().unwrap();
    let trainer = server(data.path(), &location, true).await;
    let model_id = create_model(&trainer).await;

    // Two jobs: the second trains on from step 1's adapter, read back from the bucket.
    for step in [1, 2] {
        let job = sft(&trainer, model_id).await;
        assert_eq!(
            (&job["status"], &job["step"]),
            (&json!("succeeded"), &json!(step)),
            "{job}"
        );
    }
    assert_eq!(steps(&trainer, model_id).await, [0, 1, 2]);
    // The adapters are objects in the bucket, not files on this server's disk.
    assert!(!data.path().join("adapters").exists());
    let bucket_view = Artifacts::open(&location, data.path()).await.unwrap();
    for step in [1, 2] {
        let bytes = bucket_view.get(model_id, step).await.unwrap();
        let config = trainer.state.models()[0].model.config().clone();
        temper_model::LoraAdapter::from_bytes(&bytes, "s3", &config).unwrap();
    }

    let name = "default/proj/m:step2";
    let trained = first_logprob(&trainer, name).await;
    assert_ne!(trained, first_logprob(&trainer, "tiny").await);

    // Another server on the same store: its adapter cache starts empty, so it loads the
    // checkpoint's adapter from the bucket, and answers exactly as the trainer does.
    let reader = server(data.path(), &location, false).await;
    assert_eq!(first_logprob(&reader, name).await, trained);

    // Deleting a checkpoint on one server deletes its object.
    let resp = reader
        .client
        .delete(reader.url(&format!("/v1/preview/models/{model_id}/checkpoints")))
        .bearer_auth(common::KEY)
        .json(&json!({"steps": [1]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert!(matches!(
        bucket_view.get(model_id, 1).await,
        Err(ArtifactError::NotFound(_))
    ));
    assert!(bucket_view.get(model_id, 2).await.is_ok());
    // Deleting the model deletes every object of it.
    let resp = reader
        .client
        .delete(reader.url(&format!("/v1/preview/models/{model_id}")))
        .bearer_auth(common::KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert!(matches!(
        bucket_view.get(model_id, 2).await,
        Err(ArtifactError::NotFound(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_adapter_cannot_be_stored_fails_without_a_checkpoint() {
    let test = "a_job_whose_adapter_cannot_be_stored_fails_without_a_checkpoint";
    let Some(endpoint) = s3::endpoint(test) else {
        return;
    };
    let data = tempfile::tempdir().unwrap();

    // A bucket that does not exist stops the server at start, before any job.
    let missing: ArtifactsLocation = format!("s3://temper-missing-{}", Uuid::new_v4().simple())
        .parse()
        .unwrap();
    match Catalog::open(Vec::new(), &catalog_options(data.path(), &missing)).await {
        Err(e) => assert!(e.to_string().contains("NoSuchBucket"), "{e}"),
        Ok(_) => panic!("opened the catalog on a missing bucket"),
    }

    // One that goes away after the start: the job trains, cannot store its adapter, and fails
    // with no checkpoint committed.
    let bucket = s3::Bucket::create(&endpoint).await;
    let location: ArtifactsLocation = bucket.url("adapters").parse().unwrap();
    let server = server(data.path(), &location, true).await;
    let model_id = create_model(&server).await;
    bucket.delete().await;
    let job = sft(&server, model_id).await;
    assert_eq!(job["status"], "failed", "{job}");
    let error = job["error"].as_str().unwrap();
    assert!(
        error.contains("storing the adapter") && error.contains("NoSuchBucket"),
        "{error}"
    );
    assert_eq!(steps(&server, model_id).await, [0]);
    // Its latest checkpoint is still step 0, the base weights.
    assert_eq!(
        first_logprob(&server, "default/proj/m").await,
        first_logprob(&server, "tiny").await
    );
}
