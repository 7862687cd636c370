//! Adapters by model and step, in the data directory and in a real S3-compatible server (moto,
//! under `scripts/with-s3.sh`): the same round trip on both, the local layout, and a missing
//! bucket failing at open and at a put.

mod s3;

use temper_store::{ArtifactError, Artifacts, ArtifactsLocation};
use uuid::Uuid;

/// Puts, gets, overwrites and deletes (one step, then a whole model) through `artifacts`.
async fn round_trip(artifacts: &Artifacts) {
    let (m1, m2) = (Uuid::new_v4(), Uuid::new_v4());
    assert!(matches!(
        artifacts.get(m1, 1).await,
        Err(ArtifactError::NotFound(_))
    ));
    // Larger than one read or write buffer, and not all one byte.
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    artifacts.put(m1, 1, b"one".to_vec()).await.unwrap();
    artifacts.put(m1, 2, big.clone()).await.unwrap();
    artifacts.put(m2, 1, b"other".to_vec()).await.unwrap();
    assert_eq!(artifacts.get(m1, 1).await.unwrap(), b"one");
    assert_eq!(artifacts.get(m1, 2).await.unwrap(), big);
    assert_eq!(artifacts.get(m2, 1).await.unwrap(), b"other");

    // A re-run of a step replaces its adapter.
    artifacts.put(m1, 1, b"one again".to_vec()).await.unwrap();
    assert_eq!(artifacts.get(m1, 1).await.unwrap(), b"one again");

    artifacts.delete(m1, 1).await.unwrap();
    match artifacts.get(m1, 1).await {
        Err(ArtifactError::NotFound(key)) => {
            assert!(key.ends_with(&format!("{m1}/step-1.safetensors")), "{key}")
        }
        r => panic!("expected NotFound, got {r:?}"),
    }
    // Deleting what is gone is no error.
    artifacts.delete(m1, 1).await.unwrap();
    assert_eq!(artifacts.get(m1, 2).await.unwrap(), big);

    artifacts.delete_model(m1).await.unwrap();
    assert!(matches!(
        artifacts.get(m1, 2).await,
        Err(ArtifactError::NotFound(_))
    ));
    assert_eq!(artifacts.get(m2, 1).await.unwrap(), b"other");
    artifacts.delete_model(m1).await.unwrap();
    artifacts.delete_model(Uuid::new_v4()).await.unwrap();
}

#[tokio::test]
async fn local_adapters_round_trip_in_the_data_directory() {
    let data = tempfile::tempdir().unwrap();
    let artifacts = Artifacts::open(&ArtifactsLocation::DataDir, data.path())
        .await
        .unwrap();
    round_trip(&artifacts).await;

    // Today's layout, and no temporary file left behind by a put.
    let model = Uuid::new_v4();
    artifacts.put(model, 3, b"three".to_vec()).await.unwrap();
    let dir = data.path().join("adapters").join(model.to_string());
    assert_eq!(
        std::fs::read(dir.join("step-3.safetensors")).unwrap(),
        b"three"
    );
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["step-3.safetensors"]);
    assert_eq!(
        artifacts.key(model, 3),
        dir.join("step-3.safetensors").display().to_string()
    );

    // What a put cut short leaves is removed at the next start.
    std::fs::write(dir.join("step-4.safetensors.tmp"), b"partial").unwrap();
    assert_eq!(
        artifacts.remove_stray_temp_files().await,
        [dir.join("step-4.safetensors.tmp")]
    );
    assert_eq!(artifacts.get(model, 3).await.unwrap(), b"three");
}

#[tokio::test]
async fn s3_adapters_round_trip_in_a_bucket() {
    let Some(endpoint) = s3::endpoint("s3_adapters_round_trip_in_a_bucket") else {
        return;
    };
    let bucket = s3::Bucket::create(&endpoint).await;
    let data = tempfile::tempdir().unwrap();
    let location: ArtifactsLocation = bucket.url("runs/a").parse().unwrap();
    let artifacts = Artifacts::open(&location, data.path()).await.unwrap();
    round_trip(&artifacts).await;

    // Keys sit under the prefix; another prefix of the same bucket is another store.
    let model = Uuid::new_v4();
    artifacts.put(model, 1, b"a".to_vec()).await.unwrap();
    assert_eq!(
        artifacts.key(model, 1),
        format!("s3://{}/runs/a/{model}/step-1.safetensors", bucket.name)
    );
    let other = Artifacts::open(&bucket.url("runs/b").parse().unwrap(), data.path())
        .await
        .unwrap();
    assert!(matches!(
        other.get(model, 1).await,
        Err(ArtifactError::NotFound(_))
    ));
    // Nothing of it is on the local disk.
    assert!(!data.path().join("adapters").exists());
}

#[tokio::test]
async fn a_missing_bucket_fails_at_open_and_at_a_put() {
    let Some(endpoint) = s3::endpoint("a_missing_bucket_fails_at_open_and_at_a_put") else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let missing: ArtifactsLocation = format!("s3://temper-missing-{}", Uuid::new_v4().simple())
        .parse()
        .unwrap();
    let err = Artifacts::open(&missing, data.path()).await.unwrap_err();
    assert!(matches!(err, ArtifactError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains("NoSuchBucket"), "{err}");

    // A bucket that goes away after the start: the put fails, it does not pretend.
    let bucket = s3::Bucket::create(&endpoint).await;
    let artifacts = Artifacts::open(&bucket.url("p").parse().unwrap(), data.path())
        .await
        .unwrap();
    bucket.delete().await;
    let model = Uuid::new_v4();
    let err = artifacts
        .put(model, 1, b"x".to_vec())
        .await
        .expect_err("a put into a deleted bucket");
    assert!(matches!(err, ArtifactError::Object { .. }), "{err}");
    assert!(err.to_string().contains(&artifacts.key(model, 1)), "{err}");
}
