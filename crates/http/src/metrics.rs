//! `GET /metrics`: Prometheus text (format 0.0.4). Serving figures under vLLM's names, one series
//! per served base model (`model_name` label), so dashboards built for vLLM read them; training
//! figures under `temper:` names, from the store (every team's jobs).

use std::fmt::Write;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use temper_engine::{HistogramSnapshot, RequestMetrics};

use crate::error::ApiError;
use crate::state::AppState;

/// Prometheus' text exposition format.
const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

pub async fn metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let mut out = Exposition::default();
    serving(&state, &mut out);
    if let Some(store) = state.store() {
        let totals = store
            .training_totals()
            .await
            .map_err(|e| ApiError::Internal(format!("reading training totals: {e}")))?;
        out.family("temper:training_jobs", "gauge", "Training jobs by status.");
        for status in ["queued", "running", "succeeded", "failed", "cancelled"] {
            let n = totals
                .jobs_by_status
                .iter()
                .find(|(s, _)| s == status)
                .map_or(0, |(_, n)| *n);
            out.sample("temper:training_jobs", &[("status", status)], n as f64);
        }
        out.family(
            "temper:training_job_duration_seconds",
            "summary",
            "Start to finish of succeeded training jobs (whole seconds as stored).",
        );
        out.sample(
            "temper:training_job_duration_seconds_sum",
            &[],
            totals.succeeded_job_seconds as f64,
        );
        out.sample(
            "temper:training_job_duration_seconds_count",
            &[],
            totals.succeeded_jobs as f64,
        );
        out.counter(
            "temper:gradient_steps_total",
            "Gradient steps taken by training jobs.",
            totals.gradient_steps,
        );
        out.counter(
            "temper:trained_tokens_total",
            "Trainable tokens of those gradient steps.",
            totals.trained_tokens,
        );
    }
    Ok(([(header::CONTENT_TYPE, CONTENT_TYPE)], out.text).into_response())
}

/// A series: its name, its help text and how to read it.
type Series<'a, F> = (&'a str, &'a str, F);
/// How a counter reads an engine's request metrics.
type CounterOf = fn(&RequestMetrics) -> u64;
/// How a histogram reads an engine's request metrics.
type HistogramOf = fn(&RequestMetrics) -> &HistogramSnapshot;

fn serving(state: &AppState, out: &mut Exposition) {
    let models = state.models();
    let label = |i: usize| [("model_name", models[i].name.as_str())];
    let gauges: [Series<&dyn Fn(usize) -> f64>; 5] = [
        (
            "vllm:num_requests_running",
            "Requests admitted to the batch and not finished.",
            &|i| models[i].engine.stats().running_requests as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Requests waiting for admission.",
            &|i| models[i].engine.stats().waiting as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "Fraction of the KV cache pool's blocks held by sequences (1 = full); idle \
             prefix-cache blocks count as free.",
            &|i| {
                let kv = models[i].engine.kv_cache_stats();
                let used = kv.capacity_blocks.saturating_sub(kv.available_blocks());
                used as f64 / kv.capacity_blocks.max(1) as f64
            },
        ),
        (
            "temper:model_weight_bytes",
            "Bytes of the model's weights as loaded (quantized as in the file): its projections \
             and output head.",
            &|i| models[i].model.decode_weight_bytes() as f64,
        ),
        (
            "temper:kv_cache_capacity_bytes",
            "The model's KV cache budget (--kv-cache-mb), in whole blocks; blocks are touched \
             as they are first used.",
            &|i| {
                let kv = models[i].engine.kv_cache_stats();
                (kv.capacity_blocks * kv.block_bytes) as f64
            },
        ),
    ];
    for (name, help, value) in gauges {
        out.family(name, "gauge", help);
        for i in 0..models.len() {
            out.sample(name, &label(i), value(i));
        }
    }
    let metrics: Vec<_> = models.iter().map(|m| m.engine.request_metrics()).collect();
    let counters: [Series<CounterOf>; 2] = [
        (
            "vllm:prompt_tokens_total",
            "Prompt tokens of finished requests.",
            |m| m.prompt_tokens,
        ),
        ("vllm:generation_tokens_total", "Tokens generated.", |m| {
            m.generation_tokens
        }),
    ];
    for (name, help, value) in counters {
        out.family(name, "counter", help);
        for (i, m) in metrics.iter().enumerate() {
            out.sample(name, &label(i), value(m) as f64);
        }
    }
    out.family(
        "vllm:request_success_total",
        "counter",
        "Finished choices by finish reason.",
    );
    for (i, m) in metrics.iter().enumerate() {
        for &(reason, n) in &m.finished {
            let labels = [label(i)[0], ("finished_reason", reason)];
            out.sample("vllm:request_success_total", &labels, n as f64);
        }
    }
    let histograms: [Series<HistogramOf>; 2] = [
        (
            "vllm:time_to_first_token_seconds",
            "Time from submission to the engine (the prompt tokenized) to the first token.",
            |m| &m.time_to_first_token,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Time from submission to the engine to the last choice's end.",
            |m| &m.e2e_latency,
        ),
    ];
    for (name, help, value) in histograms {
        out.family(name, "histogram", help);
        for (i, m) in metrics.iter().enumerate() {
            out.histogram(name, label(i)[0], value(m));
        }
    }
}

/// Prometheus text being written.
#[derive(Default)]
struct Exposition {
    text: String,
}

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let _ = write!(self.text, "{k}=\"{}\"", escape(v));
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {value}");
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.family(name, "counter", help);
        self.sample(name, &[], value as f64);
    }

    fn histogram(&mut self, name: &str, label: (&str, &str), h: &HistogramSnapshot) {
        let bucket = format!("{name}_bucket");
        for (bound, &count) in h.bounds.iter().zip(&h.cumulative) {
            let le = bound.to_string();
            self.sample(&bucket, &[label, ("le", &le)], count as f64);
        }
        self.sample(&bucket, &[label, ("le", "+Inf")], h.count() as f64);
        self.sample(&format!("{name}_sum"), &[label], h.sum_seconds);
        self.sample(&format!("{name}_count"), &[label], h.count() as f64);
    }
}

/// A label value with `\`, `"` and newlines escaped, as the format requires.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
