//! temper-train: trajectories → tokens, advantages, the RL loss and the LoRA optimisation loop
//! (training.md). The HTTP layer parses bodies into [`TrainingRequest`] and calls
//! [`tokenize_job`] at the edge; the job worker calls [`run_job`]. SFT jobs go the same way:
//! [`SftRequest`], [`tokenize_sft_job`], [`run_sft_job`]. [`service`] is the training service
//! around them: the job life cycle over the store, the worker, trained names and adapters.

mod pool;
mod request;
pub mod service;
mod step;
mod summary;
mod tokenize;
mod trainer;

pub use pool::{TrainerPool, TrainerThreads, DEFAULT_TRAIN_NICE};
pub use request::{
    Choice, ChoiceLogprobs, ExperimentalConfig, History, ImportanceSamplingLevel, LearningRate,
    LogGroup, LogTrajectory, LossConfig, MessageOrChoice, SftConfig, SftRequest, SftSchedule,
    SftTrajectory, TokenLogprob, TrainingRequest, Trajectory, TrajectoryGroup,
    SFT_DEFAULT_BATCH_SIZE, SFT_DEFAULT_EPOCHS, SFT_DEFAULT_LEARNING_RATE,
};
pub use step::{add_grads, forward_backward, StepDatum, StepLoss, StepOutput};
pub use summary::mean_trajectory_metrics;
pub use tokenize::{
    tokenize_job, tokenize_sft_job, TokenizedJob, TokenizedSequence, TokenizedSftJob,
};
pub use trainer::{
    adam_step, apply_gradients, group_advantages, run_job, run_sft_job, sequence_loss, AdamParams,
    AdamW, SftStepMetrics, StepMetrics, TrainEvent, TrainerConfig,
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
