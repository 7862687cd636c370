//! `GET /v1/usage` reports the tokens `crate::meter` counted, and a team past its monthly token
//! quota gets a 429.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use temper_store::{utc_date, Quota, TokenCounts};

use crate::auth::RequestContext;
use crate::error::ApiError;
use crate::extract::ValidQuery;
use crate::meter::unix_now;
use crate::state::AppState;

/// Most buckets one `GET /v1/usage` answers with.
pub const MAX_BUCKETS: i64 = 1000;

/// A 429 when the team has used its quota for this UTC month. Checked as a chat completion or a
/// training job is accepted, against the usage stored so far: requests already running finish,
/// so a team can end a little past its quota.
pub async fn check_quota(state: &AppState, team: &str) -> Result<(), ApiError> {
    let Some(store) = state.store() else {
        return Ok(());
    };
    match store.quota(team, unix_now() as i64).await? {
        Some(quota) if quota.is_exceeded() => {
            let (year, month, _) = utc_date(quota.period_start);
            let (next_year, next_month, _) = utc_date(quota.period_end);
            Err(ApiError::QuotaExceeded(format!(
                "Team {team} has used {} of its {} tokens for {year:04}-{month:02} (UTC): \
                 prompt, completion and trained tokens count. The quota resets at \
                 {next_year:04}-{next_month:02}-01 00:00 UTC; the server's operator can raise \
                 it (`temper keys quota`).",
                quota.used_tokens, quota.monthly_tokens
            )))
        }
        _ => Ok(()),
    }
}

/// `GET /v1/usage` query (all values as strings, checked here so that errors name them).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    pub start: Option<String>,
    pub end: Option<String>,
    pub bucket_width: Option<String>,
    pub group_by: Option<String>,
}

/// A validated [`UsageQuery`].
#[derive(Debug, Clone, PartialEq, Eq)]
struct UsageRange {
    /// The first bucket's start: `start` rounded down to the bucket width.
    start: i64,
    end: i64,
    width: i64,
    by_project: bool,
    by_model: bool,
}

fn parse_time(param: &'static str, value: &str) -> Result<i64, ApiError> {
    value
        .parse::<i64>()
        .ok()
        .filter(|t| (0..=i64::from(u32::MAX)).contains(t))
        .ok_or_else(|| {
            ApiError::bad(
                param,
                format!(
                    "`{param}` must be a Unix time in seconds (an integer >= 0), got {value:?}."
                ),
            )
        })
}

impl UsageQuery {
    fn validate(&self, now: i64) -> Result<UsageRange, ApiError> {
        let start = self.start.as_deref().ok_or_else(|| {
            ApiError::bad(
                "start",
                "`start` is required: the Unix time in seconds the report begins at.",
            )
        })?;
        let start = parse_time("start", start)?;
        let width = match self.bucket_width.as_deref().unwrap_or("1d") {
            "1h" => 3600,
            "1d" => 86_400,
            other => {
                return Err(ApiError::bad(
                    "bucket_width",
                    format!("`bucket_width` must be `1h` or `1d`, got {other:?}."),
                ))
            }
        };
        let end = match self.end.as_deref() {
            Some(end) => parse_time("end", end)?,
            // Through the bucket holding now.
            None => now - now % width + width,
        };
        if end <= start {
            let (param, end) = match self.end {
                Some(_) => ("end", end.to_string()),
                None => ("start", format!("{end}, the end of the current bucket")),
            };
            return Err(ApiError::bad(
                param,
                format!("`start` ({start}) must be before `end` ({end})."),
            ));
        }
        let start = start - start % width;
        let buckets = (end - start + width - 1) / width;
        if buckets > MAX_BUCKETS {
            return Err(ApiError::bad(
                "end",
                format!(
                    "The range holds {buckets} buckets of `{}`; at most {MAX_BUCKETS} are \
                     answered: narrow it or widen `bucket_width`.",
                    self.bucket_width.as_deref().unwrap_or("1d")
                ),
            ));
        }
        let (mut by_project, mut by_model) = (false, false);
        if let Some(group_by) = self.group_by.as_deref() {
            for field in group_by.split(',') {
                let seen = match field {
                    "project" => &mut by_project,
                    "model" => &mut by_model,
                    _ => {
                        return Err(ApiError::bad(
                            "group_by",
                            format!(
                                "`group_by` must be `project`, `model` or `project,model`, got \
                                 {group_by:?}."
                            ),
                        ))
                    }
                };
                if std::mem::replace(seen, true) {
                    return Err(ApiError::bad(
                        "group_by",
                        format!("`group_by` names {field:?} twice."),
                    ));
                }
            }
        }
        Ok(UsageRange {
            start,
            end,
            width,
            by_project,
            by_model,
        })
    }
}

#[derive(Debug, Serialize)]
pub struct UsagePage {
    pub object: &'static str,
    pub data: Vec<UsageBucket>,
    pub has_more: bool,
    pub next_page: Option<String>,
    /// The team's quota this UTC month; `null` without one.
    pub quota: Option<QuotaJson>,
}

#[derive(Debug, Serialize)]
pub struct UsageBucket {
    pub object: &'static str,
    pub start_time: i64,
    pub end_time: i64,
    pub results: Vec<UsageResult>,
}

#[derive(Debug, Serialize)]
pub struct UsageResult {
    pub object: &'static str,
    /// The project, when grouped by it.
    pub project_id: Option<String>,
    /// The model, when grouped by it.
    pub model: Option<String>,
    pub input_tokens: u64,
    pub input_cached_tokens: u64,
    pub output_tokens: u64,
    pub num_model_requests: u64,
    pub trained_tokens: u64,
    pub num_gradient_steps: u64,
}

#[derive(Debug, Serialize)]
pub struct QuotaJson {
    pub monthly_tokens: u64,
    pub used_tokens: u64,
    pub remaining_tokens: u64,
    pub period_start: i64,
    pub period_end: i64,
}

impl From<Quota> for QuotaJson {
    fn from(q: Quota) -> Self {
        QuotaJson {
            monthly_tokens: q.monthly_tokens,
            used_tokens: q.used_tokens,
            remaining_tokens: q.monthly_tokens.saturating_sub(q.used_tokens),
            period_start: q.period_start,
            period_end: q.period_end,
        }
    }
}

/// `GET /v1/usage`: the key's team's usage in buckets of `bucket_width` from `start` to `end`,
/// optionally per project and model, and its quota.
pub async fn usage(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    ValidQuery(q): ValidQuery<UsageQuery>,
) -> Result<Json<UsagePage>, ApiError> {
    let now = unix_now() as i64;
    let range = q.validate(now)?;
    let (Some(store), Some(meter)) = (state.store(), state.usage_meter()) else {
        return Err(ApiError::ServiceUnavailable(
            "This server runs without a store: usage is not counted.".to_owned(),
        ));
    };
    // This server's own requests are in the answer as soon as they have ended.
    meter.flush().await?;
    let rows = store.usage_rows(&ctx.team, range.start, range.end).await?;
    let quota = store.quota(&ctx.team, now).await?;
    Ok(Json(UsagePage {
        object: "page",
        data: buckets(&range, rows),
        has_more: false,
        next_page: None,
        quota: quota.map(QuotaJson::from),
    }))
}

/// Every bucket of the range, each with a result per group that used anything in it.
fn buckets(range: &UsageRange, rows: Vec<temper_store::UsageRow>) -> Vec<UsageBucket> {
    type Group = (Option<String>, Option<String>);
    let mut sums: BTreeMap<(i64, Group), TokenCounts> = BTreeMap::new();
    for row in rows {
        let bucket = row.bucket_start - row.bucket_start % range.width;
        let group = (
            range.by_project.then_some(row.project),
            range.by_model.then_some(row.model),
        );
        *sums.entry((bucket, group)).or_default() += row.counts;
    }
    let mut out: Vec<UsageBucket> = (range.start..range.end)
        .step_by(range.width as usize)
        .map(|start| UsageBucket {
            object: "bucket",
            start_time: start,
            end_time: start + range.width,
            results: Vec::new(),
        })
        .collect();
    for ((bucket, (project_id, model)), c) in sums {
        let i = ((bucket - range.start) / range.width) as usize;
        if let Some(b) = out.get_mut(i) {
            b.results.push(UsageResult {
                object: "usage.result",
                project_id,
                model,
                input_tokens: c.input_tokens,
                input_cached_tokens: c.cached_input_tokens,
                output_tokens: c.output_tokens,
                num_model_requests: c.num_model_requests,
                trained_tokens: c.trained_tokens,
                num_gradient_steps: c.num_gradient_steps,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(
        start: &str,
        end: Option<&str>,
        width: Option<&str>,
        group_by: Option<&str>,
    ) -> UsageQuery {
        UsageQuery {
            start: Some(start.into()),
            end: end.map(Into::into),
            bucket_width: width.map(Into::into),
            group_by: group_by.map(Into::into),
        }
    }

    fn param(e: ApiError) -> String {
        assert_eq!(e.status().as_u16(), 400, "{e}");
        serde_json::to_value(e.envelope()).unwrap()["error"]["param"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn queries_are_validated() {
        let now = 100 * 86_400 + 5;
        let r = query("86500", None, None, None).validate(now).unwrap();
        assert_eq!(
            r,
            UsageRange {
                start: 86_400,
                end: 101 * 86_400,
                width: 86_400,
                by_project: false,
                by_model: false
            }
        );
        let r = query("7300", Some("7400"), Some("1h"), Some("model,project"))
            .validate(now)
            .unwrap();
        assert_eq!((r.start, r.end, r.width), (7200, 7400, 3600));
        assert!(r.by_project && r.by_model);
        let bad = |q: UsageQuery| param(q.validate(now).unwrap_err());
        assert_eq!(bad(UsageQuery::default()), "start");
        for start in ["-1", "x", "1.5", "", "99999999999"] {
            assert_eq!(bad(query(start, None, None, None)), "start", "{start}");
        }
        assert_eq!(bad(query("10", Some("10"), None, None)), "end");
        assert_eq!(
            bad(query(&(101 * 86_400).to_string(), None, None, None)),
            "start"
        );
        assert_eq!(bad(query("10", Some("abc"), None, None)), "end");
        assert_eq!(bad(query("10", None, Some("1m"), None)), "bucket_width");
        for g in ["projects", "project,", "project,project", "", "project_id"] {
            assert_eq!(bad(query("10", None, None, Some(g))), "group_by", "{g}");
        }
        // 1001 hours.
        assert_eq!(bad(query("0", Some("3603600"), Some("1h"), None)), "end");
        assert!(query("0", Some("3600000"), Some("1h"), None)
            .validate(now)
            .is_ok());
    }

    #[test]
    fn rows_sum_into_buckets_and_groups() {
        let row = |bucket_start, project: &str, model: &str, input| temper_store::UsageRow {
            bucket_start,
            project: project.into(),
            model: model.into(),
            counts: TokenCounts {
                input_tokens: input,
                num_model_requests: 1,
                ..TokenCounts::default()
            },
        };
        let rows = || {
            vec![
                row(0, "a", "m", 1),
                row(3600, "b", "m", 2),
                row(86_400 + 7200, "a", "n", 4),
            ]
        };
        let mut range = UsageRange {
            start: 0,
            end: 3 * 86_400,
            width: 86_400,
            by_project: false,
            by_model: false,
        };
        let out = buckets(&range, rows());
        let summary: Vec<(i64, Vec<u64>)> = out
            .iter()
            .map(|b| {
                (
                    b.start_time,
                    b.results.iter().map(|r| r.input_tokens).collect(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            [(0, vec![3]), (86_400, vec![4]), (172_800, vec![])]
        );
        assert_eq!(out[0].results[0].num_model_requests, 2);
        assert_eq!(out[0].results[0].project_id, None);
        range.by_project = true;
        let out = buckets(&range, rows());
        let projects: Vec<(Option<&str>, u64)> = out[0]
            .results
            .iter()
            .map(|r| (r.project_id.as_deref(), r.input_tokens))
            .collect();
        assert_eq!(projects, [(Some("a"), 1), (Some("b"), 2)]);
        assert_eq!(out[0].results[0].model, None);
    }
}
