//! Bookkeeping metrics of a job's trajectories, echoed with its training metrics: how far off
//! policy they were, and the mean of their own `metrics` (as the agent library averages them).

use serde_json::{json, Map, Value};

use crate::request::{TrainingRequest, Trajectory};

/// The mean of every numeric (or boolean: 0/1) key of the trajectories' `metrics`, each over
/// the trajectories that have it, named `<prefix><key>`.
pub fn mean_trajectory_metrics<'a>(
    metrics: impl IntoIterator<Item = &'a Map<String, Value>>,
    prefix: &str,
) -> Map<String, Value> {
    let mut sums: std::collections::BTreeMap<&str, (f64, f64)> = Default::default();
    for m in metrics {
        for (name, value) in m {
            if let Some(x) = value.as_f64().or_else(|| value.as_bool().map(f64::from)) {
                let entry = sums.entry(name).or_default();
                *entry = (entry.0 + x, entry.1 + 1.0);
            }
        }
    }
    sums.into_iter()
        .map(|(name, (sum, count))| (format!("{prefix}{name}"), json!(sum / count)))
        .collect()
}

/// How many checkpoints behind `current_step` a trajectory was sampled: from its
/// `initial_policy_version`, else its `final_policy_version`; `None` without either.
fn steps_off_policy(t: &Trajectory, current_step: i64) -> Option<i64> {
    t.initial_policy_version
        .or(t.final_policy_version)
        .map(|version| current_step - version)
}

impl TrainingRequest {
    /// The job's bookkeeping metrics when it trains from checkpoint `current_step`:
    /// `off_policy_steps` (mean) and `off_policy_steps_max` over the trajectories that carry a
    /// policy version (absent when none does), and `train/<key>` for each numeric trajectory
    /// metric (see [`mean_trajectory_metrics`]).
    pub fn bookkeeping_metrics(&self, current_step: i64) -> Map<String, Value> {
        let trajectories = || self.trajectory_groups.iter().flat_map(|g| &g.trajectories);
        let mut out = mean_trajectory_metrics(trajectories().map(|t| &t.metrics), "train/");
        let off: Vec<i64> = trajectories()
            .filter_map(|t| steps_off_policy(t, current_step))
            .collect();
        if let Some(max) = off.iter().max() {
            let mean = off.iter().sum::<i64>() as f64 / off.len() as f64;
            out.insert("off_policy_steps".to_owned(), json!(mean));
            out.insert("off_policy_steps_max".to_owned(), json!(max));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_policy_steps_and_metric_means() {
        let req: TrainingRequest = serde_json::from_value(json!({"trajectory_groups": [
            {"trajectories": [
                {"messages_and_choices": [], "initial_policy_version": 3, "final_policy_version": 4,
                 "metrics": {"correct": true, "turns": 2}},
                {"messages_and_choices": [], "final_policy_version": 5,
                 "metrics": {"correct": false, "note": "text"}}
            ]},
            {"trajectories": [{"messages_and_choices": [], "metrics": {"turns": 4.0}}]}
        ]}))
        .unwrap();
        // Versions 3 (initial wins over final) and 5 at step 5: 2 and 0 steps off; the third
        // trajectory has none and is left out.
        assert_eq!(
            Value::Object(req.bookkeeping_metrics(5)),
            json!({"train/correct": 0.5, "train/turns": 3.0,
                   "off_policy_steps": 1.0, "off_policy_steps_max": 2})
        );
        let none: TrainingRequest = serde_json::from_value(
            json!({"trajectory_groups": [{"trajectories": [{"messages_and_choices": []}]}]}),
        )
        .unwrap();
        assert_eq!(none.bookkeeping_metrics(1), Map::new());
    }
}
