//! temper-train: trajectories → tokens, advantages, the RL loss and the LoRA optimisation loop
//! (training.md). The HTTP layer parses bodies into [`TrainingRequest`] and calls
//! [`tokenize_job`] at the edge; the job worker calls [`run_job`].

mod request;
mod tokenize;
mod trainer;

pub use request::{
    Choice, ChoiceLogprobs, ExperimentalConfig, History, ImportanceSamplingLevel, LossConfig,
    MessageOrChoice, TokenLogprob, TrainingRequest, Trajectory, TrajectoryGroup,
};
pub use tokenize::{tokenize_job, TokenizedJob, TokenizedSequence};
pub use trainer::{
    group_advantages, run_job, sequence_loss, StepMetrics, TrainEvent, TrainerConfig,
};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The request cannot be trained on; `param` is the field's path in the body.
    #[error("{param}: {message}")]
    Invalid { param: String, message: String },
    #[error("model: {0}")]
    Model(#[from] temper_model::ModelError),
    #[error("training diverged: {0}")]
    NonFinite(String),
    #[error("the job was cancelled")]
    Cancelled,
}

impl TrainError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        TrainError::Invalid {
            param: param.into(),
            message: message.into(),
        }
    }
}
