//! The training API's routes over the training service (`temper_train::service`): wire types,
//! `Idempotency-Key`s, and resolving a request's `model` to a base or trained model.

pub mod idempotency;
pub mod routes;
pub mod wire;

use std::sync::Arc;

use temper_store::Checkpoint;

use crate::error::ApiError;
use crate::state::{AppState, ServedModel};

/// What a request's `model` names: a served base model, and for a trained name the checkpoint
/// whose adapter goes on top of it.
pub struct ResolvedModel {
    pub base: Arc<ServedModel>,
    /// The name as the request gave it (echoed in the response).
    pub name: String,
    pub checkpoint: Option<Checkpoint>,
}

/// Resolves a request's `model`: a base model's own name first, then a trained name of the
/// key's team through the training service. Unknown names, another team's and missing steps
/// are all the same 404.
pub async fn resolve_model(
    state: &AppState,
    requested: Option<&str>,
    team: &str,
) -> Result<ResolvedModel, ApiError> {
    let base_err = match state.model(requested) {
        Ok(base) => {
            return Ok(ResolvedModel {
                name: base.name.clone(),
                base,
                checkpoint: None,
            })
        }
        Err(e) => e,
    };
    let (Some(requested), Some(training)) = (requested, state.training()) else {
        return Err(base_err);
    };
    let Some(trained) = training.resolve(team, requested).await? else {
        return Err(ApiError::ModelNotFound(requested.to_owned()));
    };
    let base = state.model(Some(&trained.model.base_model)).map_err(|_| {
        ApiError::ServiceUnavailable(format!(
            "The base model `{}` of `{requested}` is not served by this server.",
            trained.model.base_model
        ))
    })?;
    Ok(ResolvedModel {
        base,
        name: requested.to_owned(),
        checkpoint: Some(trained.checkpoint),
    })
}
