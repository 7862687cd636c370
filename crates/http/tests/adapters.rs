//! Adapters out and in through real HTTP on the tiny model with a real store and worker: a
//! trained checkpoint exported (PEFT tar, llama.cpp GGUF), imported as another model's step (tar
//! and multipart bodies) and served with the same logprobs bit for bit, trained on by the next
//! job; bad files a 400 naming the tensor; tenancy, busy models and idempotent retries.

mod common;

use std::io::Read;
use std::time::{Duration, Instant};

use common::{options, TestServer, KEY};
use serde_json::{json, Value};
use temper_http::{CatalogOptions, TrainingOptions};

struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    bytes: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.bytes).unwrap_or(Value::Null)
    }

    fn param(&self) -> String {
        self.json()["error"]["param"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    }
}

async fn send(req: reqwest::RequestBuilder) -> Answer {
    let resp = req.send().await.unwrap();
    Answer {
        status: resp.status().as_u16(),
        headers: resp.headers().clone(),
        bytes: resp.bytes().await.unwrap().to_vec(),
    }
}

async fn get(server: &TestServer, path: &str) -> Answer {
    send(server.client.get(server.url(path)).bearer_auth(KEY)).await
}

/// An import of `body` with `content_type`, optionally with an `Idempotency-Key`.
async fn import(
    server: &TestServer,
    model_id: &str,
    content_type: &str,
    body: Vec<u8>,
    idempotency_key: Option<&str>,
) -> Answer {
    let mut req = server
        .client
        .post(server.url(&format!("/v1/preview/models/{model_id}/checkpoints")))
        .bearer_auth(KEY)
        .header("Content-Type", content_type)
        .body(body);
    if let Some(k) = idempotency_key {
        req = req.header("Idempotency-Key", k);
    }
    send(req).await
}

async fn create_model(server: &TestServer, name: &str) -> String {
    let body = json!({"project": "proj", "name": name, "base_model": "tiny"});
    server.post_ok("/v1/preview/models", &body).await["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

async fn sft(server: &TestServer, model_id: &str) -> Value {
    let line =
        |q: &str, a: &str| json!({"messages": [user(q), {"role": "assistant", "content": a}]});
    let job = server
        .post_ok(
            "/v1/preview/sft-training-jobs",
            &json!({"model_id": model_id, "trajectories": [line("hi", "hello world"), line("the cat", "sat on the mat")],
                    "config": {"learning_rate": 2e-2}}),
        )
        .await;
    let id = job["id"].as_str().unwrap().to_owned();
    let start = Instant::now();
    loop {
        let j = get(server, &format!("/v1/preview/training-jobs/{id}"))
            .await
            .json();
        if ["succeeded", "failed", "cancelled"].contains(&j["status"].as_str().unwrap()) {
            assert_eq!(j["status"], "succeeded", "{j}");
            return j;
        }
        assert!(start.elapsed() < Duration::from_secs(300), "{j}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The tiny model with the training service over a store in `data`, its job worker running.
async fn training_server(data: &std::path::Path) -> TestServer {
    let server = TestServer::tiny_training(
        options(),
        CatalogOptions::new(data),
        TrainingOptions::default(),
        None,
    )
    .await;
    server.state.training().unwrap().spawn_worker().unwrap();
    server
}

/// Greedy text and every logprob (sampled and top 5) of `model` on two prompts.
async fn served(server: &TestServer, model: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for prompt in ["hi", "the cat sat on"] {
        let r = server
            .post_ok(
                "/v1/chat/completions",
                &json!({"model": model, "messages": [user(prompt)], "max_tokens": 6,
                        "temperature": 0.0, "logprobs": true, "top_logprobs": 5}),
            )
            .await;
        out.push(json!([
            r["choices"][0]["message"]["content"],
            r["choices"][0]["logprobs"]
        ]));
    }
    out
}

fn untar(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut archive = tar::Archive::new(bytes);
    archive
        .entries()
        .unwrap()
        .map(|e| {
            let mut e = e.unwrap();
            let name = e.path().unwrap().to_string_lossy().into_owned();
            let mut data = Vec::new();
            e.read_to_end(&mut data).unwrap();
            (name, data)
        })
        .collect()
}

fn tar_of(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (name, bytes) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        builder.append_data(&mut header, name, *bytes).unwrap();
    }
    builder.into_inner().unwrap()
}

fn multipart(files: &[(&str, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "temper-test-boundary-7f3a";
    let mut body = Vec::new();
    for (name, bytes) in files {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\
                 Content-Type: application/octet-stream\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

#[tokio::test]
async fn an_exported_checkpoint_imports_with_the_same_logprobs_and_trains_on() {
    let data = tempfile::tempdir().unwrap();
    let server = training_server(data.path()).await;
    let trained = create_model(&server, "trained").await;
    sft(&server, &trained).await;

    // PEFT: a tar of the two files, named for the checkpoint.
    let peft = get(
        &server,
        &format!("/v1/preview/models/{trained}/checkpoints/1/adapter?format=peft"),
    )
    .await;
    assert_eq!(peft.status, 200, "{}", String::from_utf8_lossy(&peft.bytes));
    assert_eq!(peft.headers["content-type"], "application/x-tar");
    assert_eq!(
        peft.headers["content-disposition"],
        "attachment; filename=\"proj-trained-step1-peft.tar\""
    );
    let files = untar(&peft.bytes);
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["adapter_model.safetensors", "adapter_config.json"]);
    let config: Value = serde_json::from_slice(&files[1].1).unwrap();
    assert_eq!(
        (
            &config["peft_type"],
            &config["r"],
            &config["lora_alpha"],
            &config["base_model_name_or_path"]
        ),
        (&json!("LORA"), &json!(8), &json!(16.0), &json!("tiny"))
    );
    // The default format is PEFT.
    let default = get(
        &server,
        &format!("/v1/preview/models/{trained}/checkpoints/1/adapter"),
    )
    .await;
    assert_eq!(untar(&default.bytes), files);

    // GGUF: one llama.cpp adapter file.
    let gguf = get(
        &server,
        &format!("/v1/preview/models/{trained}/checkpoints/1/adapter?format=gguf"),
    )
    .await;
    assert_eq!(gguf.status, 200);
    assert_eq!(gguf.headers["content-type"], "application/octet-stream");
    assert_eq!(
        gguf.headers["content-disposition"],
        "attachment; filename=\"proj-trained-step1-lora.gguf\""
    );
    assert_eq!(&gguf.bytes[..4], b"GGUF");
    for key in ["adapter.lora.alpha", "blk.3.ffn_down.weight.lora_b"] {
        assert!(
            gguf.bytes.windows(key.len()).any(|w| w == key.as_bytes()),
            "{key}"
        );
    }

    // Imported into another model (a tar body, then a multipart form): its step 1 and step 2,
    // served by name at once with the trained checkpoint's logprobs, bit for bit.
    let want = served(&server, "default/proj/trained:step1").await;
    assert_ne!(
        want,
        served(&server, "tiny").await,
        "the SFT job changed nothing"
    );
    let copy = create_model(&server, "copy").await;
    let body = tar_of(&[
        ("./adapter_config.json", &files[1].1),
        ("./adapter_model.safetensors", &files[0].1),
        ("./README.md", b"notes"),
    ]);
    let first = import(&server, &copy, "application/x-tar", body, None).await;
    assert_eq!(first.status, 200, "{}", first.json());
    assert_eq!(first.json()["step"], 1);
    assert_eq!(first.json()["metrics"]["imported"], true);
    assert_eq!(served(&server, "default/proj/copy").await, want);
    let (content_type, body) = multipart(&[
        ("adapter_model.safetensors", &files[0].1),
        ("adapter_config.json", &files[1].1),
    ]);
    let second = import(&server, &copy, &content_type, body, None).await;
    assert_eq!(
        (second.status, &second.json()["step"]),
        (200, &json!(2)),
        "{}",
        second.json()
    );
    assert_eq!(served(&server, "default/proj/copy:step2").await, want);
    let listed = get(&server, &format!("/v1/preview/models/{copy}/checkpoints"))
        .await
        .json();
    let steps: Vec<&Value> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["step"])
        .collect();
    assert_eq!(steps, [&json!(0), &json!(1), &json!(2)]);
    // Exported again, the same files.
    let again = get(
        &server,
        &format!("/v1/preview/models/{copy}/checkpoints/2/adapter"),
    )
    .await;
    let again = untar(&again.bytes);
    assert_eq!(again[0], files[0]);

    // The next job trains from the imported step.
    let job = sft(&server, &copy).await;
    assert_eq!(job["step"], 3, "{job}");
    assert_ne!(served(&server, "default/proj/copy").await, want);

    // Step 0 has no adapter; an unknown format or step is a 400, a missing step a 404, and
    // another team's model a 404.
    let step0 = get(
        &server,
        &format!("/v1/preview/models/{copy}/checkpoints/0/adapter"),
    )
    .await;
    assert_eq!((step0.status, step0.param()), (400, "step".to_owned()));
    let format = get(
        &server,
        &format!("/v1/preview/models/{copy}/checkpoints/1/adapter?format=onnx"),
    )
    .await;
    assert_eq!((format.status, format.param()), (400, "format".to_owned()));
    let step = get(
        &server,
        &format!("/v1/preview/models/{copy}/checkpoints/x/adapter"),
    )
    .await;
    assert_eq!((step.status, step.param()), (400, "step".to_owned()));
    let missing = get(
        &server,
        &format!("/v1/preview/models/{copy}/checkpoints/9/adapter"),
    )
    .await;
    assert_eq!(missing.status, 404);
    let store = &server.state.training().unwrap().store;
    let (_, other) = store.create_key("acme").await.unwrap();
    let path = format!("/v1/preview/models/{trained}/checkpoints/1/adapter");
    let foreign = send(server.client.get(server.url(&path)).bearer_auth(&other)).await;
    assert_eq!(foreign.status, 404);
    let (content_type, body) = multipart(&[
        ("adapter_model.safetensors", &files[0].1),
        ("adapter_config.json", &files[1].1),
    ]);
    let req = server
        .client
        .post(server.url(&format!("/v1/preview/models/{copy}/checkpoints")))
        .bearer_auth(&other)
        .header("Content-Type", content_type)
        .body(body);
    assert_eq!(send(req).await.status, 404);
}

/// Named F32 tensors: name, shape, values.
type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// A safetensors file of F32 tensors.
fn safetensors(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        header.insert(
            name.clone(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut header = serde_json::to_vec(&Value::Object(header)).unwrap();
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header);
    out.extend(data);
    out
}

/// A PEFT adapter of rank 4 for the tiny model (4 layers, width 64, q 64, k/v 32, FFN 256) on
/// q and v only, as PEFT's default targets.
fn peft_tensors() -> Tensors {
    let mut out = Vec::new();
    for layer in 0..4 {
        for (module, out_dim) in [("q_proj", 64), ("v_proj", 32)] {
            let name = |m: &str| {
                format!("base_model.model.model.layers.{layer}.self_attn.{module}.lora_{m}.weight")
            };
            let values = |n: usize| {
                (0..n)
                    .map(|i| ((i * 7919 % 101) as f32 - 50.0) * 1e-3)
                    .collect()
            };
            out.push((name("A"), vec![4, 64], values(4 * 64)));
            out.push((name("B"), vec![out_dim, 4], values(out_dim * 4)));
        }
    }
    out
}

const CONFIG: &[u8] =
    br#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}"#;
const Q_B: &str = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight";

#[tokio::test]
async fn bad_adapter_files_are_a_400_naming_the_tensor() {
    let data = tempfile::tempdir().unwrap();
    let training = TrainingOptions {
        max_body_bytes: 1 << 20,
        ..TrainingOptions::default()
    };
    // No worker: a posted job stays queued.
    let server =
        TestServer::tiny_training(options(), CatalogOptions::new(data.path()), training, None)
            .await;
    let model = create_model(&server, "m").await;
    let post = |tensors: Tensors, config: &[u8]| {
        let body = tar_of(&[
            ("adapter_model.safetensors", &safetensors(&tensors)),
            ("adapter_config.json", config),
        ]);
        import(&server, &model, "application/x-tar", body, None)
    };
    let edited = |edit: &dyn Fn(&mut Tensors)| {
        let mut t = peft_tensors();
        edit(&mut t);
        t
    };
    let at = |t: &mut Tensors, name: &str| t.iter().position(|(n, _, _)| n == name).unwrap();

    let nan = edited(&|t| {
        let i = at(t, Q_B);
        t[i].2[5] = f32::NAN;
    });
    let wrong_shape = edited(&|t| {
        let i = at(t, Q_B);
        t[i] = (Q_B.to_owned(), vec![32, 4], vec![0.0; 128]);
    });
    let oversize = edited(&|t| {
        let i = at(t, Q_B);
        t[i] = (Q_B.to_owned(), vec![64, 64], vec![0.0; 64 * 64]);
    });
    let unknown = "base_model.model.model.layers.0.self_attn.rotary_emb.lora_A.weight";
    let unknown_target = edited(&|t| t.push((unknown.to_owned(), vec![4, 64], vec![0.0; 256])));
    let layer = "base_model.model.model.layers.4.self_attn.q_proj.lora_A.weight";
    let too_deep = edited(&|t| t.push((layer.to_owned(), vec![4, 64], vec![0.0; 256])));
    let half = edited(&|t| {
        let i = at(t, Q_B);
        t.remove(i);
    });
    for (tensors, config, param, what) in [
        (nan, CONFIG, Q_B, "non-finite"),
        (wrong_shape, CONFIG, Q_B, "[32, 4]"),
        (oversize, CONFIG, Q_B, "[64, 64]"),
        (unknown_target, CONFIG, unknown, "not a LoRA tensor"),
        (too_deep, CONFIG, layer, "4 layers"),
        (half, CONFIG, Q_B, "missing"),
        (
            peft_tensors(),
            br#"{"r": 4, "target_modules": ["embed_tokens"]}"#,
            "adapter_config.json: target_modules",
            "embed_tokens",
        ),
        (
            peft_tensors(),
            br#"{"r": 1000}"#,
            "adapter_config.json: r",
            "1000",
        ),
        (peft_tensors(), b"{", "adapter_config.json", "JSON"),
    ] {
        let a = post(tensors, config).await;
        assert_eq!(
            (a.status, a.param()),
            (400, param.to_owned()),
            "{}",
            a.json()
        );
        let message = a.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(
            message.contains(param) && message.contains(what),
            "{message}"
        );
    }
    // The files themselves: one missing, not a tar, not safetensors, another content type,
    // over the body limit.
    let no_config = tar_of(&[("adapter_model.safetensors", &safetensors(&peft_tensors()))]);
    let a = import(&server, &model, "application/x-tar", no_config, None).await;
    assert_eq!(
        (a.status, a.param()),
        (400, "adapter_config.json".to_owned())
    );
    let a = import(
        &server,
        &model,
        "application/x-tar",
        b"not a tar at all".repeat(64),
        None,
    )
    .await;
    assert_eq!(a.status, 400, "{}", a.json());
    let a = post(vec![], CONFIG).await;
    assert_eq!(
        (a.status, a.param()),
        (400, "adapter_model.safetensors".to_owned())
    );
    let a = import(&server, &model, "application/json", b"{}".to_vec(), None).await;
    assert_eq!(a.status, 400);
    let huge = vec![(Q_B.to_owned(), vec![64, 4096], vec![0.0; 64 * 4096])];
    let a = post(huge, CONFIG).await;
    assert_eq!(a.status, 413, "{}", a.json());
    // Nothing was stored.
    let listed = get(&server, &format!("/v1/preview/models/{model}/checkpoints"))
        .await
        .json();
    assert_eq!(listed["data"].as_array().unwrap().len(), 1, "{listed}");

    // A good one imports (retried with its Idempotency-Key: the same answer, no second step).
    let good = || {
        tar_of(&[
            ("adapter_model.safetensors", &safetensors(&peft_tensors())),
            ("adapter_config.json", CONFIG),
        ])
    };
    let first = import(
        &server,
        &model,
        "application/x-tar",
        good(),
        Some("import-1"),
    )
    .await;
    assert_eq!(
        (first.status, &first.json()["step"]),
        (200, &json!(1)),
        "{}",
        first.json()
    );
    let retry = import(
        &server,
        &model,
        "application/x-tar",
        good(),
        Some("import-1"),
    )
    .await;
    assert_eq!((retry.status, retry.json()), (200, first.json()));
    assert!(retry.headers.contains_key("idempotent-replayed"));
    assert_eq!(first.json()["metrics"]["lora_rank"], 4);

    // While a job is queued for the model, an import would race it for the step: a 409.
    let choice = json!({"message": {"role": "assistant", "content": "x"}, "finish_reason": "stop",
        "index": 0, "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.1}]}});
    server
        .post_ok(
            "/v1/preview/training-jobs",
            &json!({"model_id": model, "trajectory_groups": [{"trajectories": [
                {"messages_and_choices": [user("q"), choice.clone()], "reward": 1.0},
                {"messages_and_choices": [user("q"), choice], "reward": 0.0}]}]}),
        )
        .await;
    let busy = import(&server, &model, "application/x-tar", good(), None).await;
    assert_eq!(busy.status, 409, "{}", busy.json());
}

/// A PEFT adapter that adapts `lm_head` too (as a Tinker run's `train_unembed` exports): imported,
/// served by name with the LM-head pair's term (its logprobs move), exported back with it, and
/// the model's next job trains from it (the job path's backward computes the LM head's chunks
/// again for the pair). A GGUF export of it is a 400: the tiny model's LM head is its embedding.
#[tokio::test]
async fn an_adapter_with_an_lm_head_pair_imports_serves_exports_and_trains() {
    let data = tempfile::tempdir().unwrap();
    let server = training_server(data.path()).await;
    let config = server.state.models()[0].model.config().clone();
    let (vocab, hidden) = (config.vocab_size, config.hidden_size);
    let layers_only = create_model(&server, "layers").await;
    let with_head = create_model(&server, "head").await;
    let pseudo = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 % 101) as f32 - 50.0) * 4e-3)
            .collect()
    };
    let mut tensors = peft_tensors();
    let layer_files = tar_of(&[
        ("adapter_model.safetensors", &safetensors(&tensors)),
        ("adapter_config.json", CONFIG),
    ]);
    let imported = import(
        &server,
        &layers_only,
        "application/x-tar",
        layer_files,
        None,
    )
    .await;
    assert_eq!(imported.status, 200, "{}", imported.json());
    tensors.push((
        "base_model.model.lm_head.lora_A.weight".to_owned(),
        vec![4, hidden],
        pseudo(4 * hidden),
    ));
    tensors.push((
        "base_model.model.lm_head.lora_B.weight".to_owned(),
        vec![vocab, 4],
        pseudo(vocab * 4),
    ));
    let config_json = br#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "lm_head"]}"#;
    let head_files = tar_of(&[
        ("adapter_model.safetensors", &safetensors(&tensors)),
        ("adapter_config.json", config_json),
    ]);
    let imported = import(&server, &with_head, "application/x-tar", head_files, None).await;
    assert_eq!(imported.status, 200, "{}", imported.json());
    let headed = served(&server, "default/proj/head").await;
    assert_ne!(
        headed,
        served(&server, "default/proj/layers").await,
        "the LM-head pair changed nothing"
    );

    let peft = get(
        &server,
        &format!("/v1/preview/models/{with_head}/checkpoints/1/adapter"),
    )
    .await;
    let files = untar(&peft.bytes);
    let exported: Value = serde_json::from_slice(&files[1].1).unwrap();
    assert!(
        exported["target_modules"]
            .as_array()
            .unwrap()
            .contains(&json!("lm_head")),
        "{exported}"
    );
    let key = b"base_model.model.lm_head.lora_B.weight";
    assert!(files[0].1.windows(key.len()).any(|w| w == key));
    let gguf = get(
        &server,
        &format!("/v1/preview/models/{with_head}/checkpoints/1/adapter?format=gguf"),
    )
    .await;
    assert_eq!((gguf.status, gguf.param()), (400, "format".to_owned()));

    let job = sft(&server, &with_head).await;
    assert_eq!(job["step"], 2, "{job}");
    assert_ne!(served(&server, "default/proj/head").await, headed);
    // The job trained the LM-head pair too.
    let head_b = |files: &[(String, Vec<u8>)]| -> Vec<f32> {
        let peft = temper_model::PeftFiles {
            weights: files[0].1.clone(),
            config: files[1].1.clone(),
        };
        let adapter = temper_model::LoraAdapter::from_peft(&peft, &config, 0).unwrap();
        adapter.params().last().unwrap().to_vec()
    };
    let after = get(
        &server,
        &format!("/v1/preview/models/{with_head}/checkpoints/2/adapter"),
    )
    .await;
    assert_ne!(head_b(&untar(&after.bytes)), head_b(&files));
}
