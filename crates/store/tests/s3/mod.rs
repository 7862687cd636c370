//! The S3-compatible server of `scripts/with-s3.sh` (moto), for tests of adapters in a bucket.
//! Shared by the store's and the HTTP server's tests (`#[path]`-included there).
//!
//! Without the server a test skips with a printed reason, unless `TEMPER_REQUIRE_S3=1` (set by
//! `make test`): then it fails.

#![allow(dead_code)] // each test binary uses a different part of this module

/// The server's URL (the `AWS_*` variables for the S3 client are set beside it), or `None`
/// when the test is to be skipped.
pub fn endpoint(test: &str) -> Option<String> {
    match std::env::var("TEMPER_TEST_S3_ENDPOINT") {
        Ok(endpoint) => Some(endpoint),
        Err(_) if std::env::var("TEMPER_REQUIRE_S3").as_deref() == Ok("1") => {
            panic!("{test}: TEMPER_REQUIRE_S3=1 but no S3 server: run it under scripts/with-s3.sh")
        }
        Err(_) => {
            eprintln!(
                "{test}: skipped, no S3 server (TEMPER_TEST_S3_ENDPOINT is unset; \
                 scripts/with-s3.sh runs a command beside one)"
            );
            None
        }
    }
}

/// A bucket of its own for one test. moto takes these bucket requests unsigned (a real S3
/// would not); the adapters themselves go through the signed client under test.
pub struct Bucket {
    endpoint: String,
    pub name: String,
}

impl Bucket {
    pub async fn create(endpoint: &str) -> Bucket {
        let bucket = Bucket {
            endpoint: endpoint.to_owned(),
            name: format!("temper-test-{}", uuid::Uuid::new_v4().simple()),
        };
        bucket.request(reqwest::Method::PUT).await;
        bucket
    }

    /// Removes the (empty) bucket, so that the next write to it fails.
    pub async fn delete(&self) {
        self.request(reqwest::Method::DELETE).await;
    }

    async fn request(&self, method: reqwest::Method) {
        let url = format!("{}/{}", self.endpoint, self.name);
        let resp = reqwest::Client::new()
            .request(method.clone(), &url)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
        assert!(
            resp.status().is_success(),
            "{method} {url}: {}",
            resp.status()
        );
    }

    /// `s3://bucket/prefix`.
    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{}/{prefix}", self.name)
    }
}
